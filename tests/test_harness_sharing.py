"""Engines are started once per model, dtype and args and shared by the tests that ask for them;
a test gets a shared engine with no adapter loaded (the harness unloads every adapter and asks the
engine itself that none is left), and capabilities the engine class declares decide skips before
anything starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_conformance.engines import AdapterNotLoadedError, Capability, Engine
from lora_conformance.context import TestContext
from lora_conformance.harness import Harness
from lora_conformance.settings import Settings

STARTED: list["CountingEngine"] = []


class CountingEngine(Engine):
    """Keeps adapters in a dict; ``forgetful`` engines report an unloaded adapter as still loaded."""

    name = "counting"
    forgetful = False

    @classmethod
    def declared_capabilities(cls, cfg, model_dir, device):
        return frozenset({Capability.DYNAMIC_LOADING})

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, args)
        self.capabilities = frozenset({Capability.DYNAMIC_LOADING})
        self.loaded: dict[str, Path] = {}
        self.ghosts: list[str] = []
        self.closed = False
        STARTED.append(self)

    def load_adapter(self, name, path, pinned=False):
        self.loaded[name] = Path(path)

    def unload_adapter(self, name):
        if name not in self.loaded:
            raise AdapterNotLoadedError(name, list(self.loaded))
        del self.loaded[name]
        if self.forgetful:
            self.ghosts.append(name)

    def list_adapters(self):
        return sorted(self.loaded)

    def engine_adapters(self):
        return sorted(set(self.loaded) | set(self.ghosts))

    def generate(self, requests):
        return []

    def close(self):
        self.closed = True


class ForgetfulEngine(CountingEngine):
    forgetful = True


def _harness(tmp_path: Path, engine: str = "CountingEngine", module: str = __name__) -> Harness:
    """A harness whose engine is ``module``'s class ``engine``."""
    return Harness(Settings(device="cpu", device_spec="cpu", engine=f"{module}:{engine}", engine_args={},
                            base_model="synthetic:llama", dtype="float32", reference_device="cpu",
                            reference_dtype="float32", cache_dir=tmp_path, refresh_references=False,
                            report_dir=None, expectations=None))


def _context(harness: Harness, tmp_path: Path) -> TestContext:
    """A TestContext without pytest's request: the model dir is set directly."""
    notes: list[str] = []
    node = SimpleNamespace(callspec=None, user_properties=[], get_closest_marker=lambda name: None)
    ctx = TestContext.__new__(TestContext)
    ctx.harness, ctx.settings, ctx.request = harness, harness.settings, SimpleNamespace(node=node)
    ctx.dtype, ctx.device, ctx.model_dir = "float32", "cpu", tmp_path
    ctx._loaded, ctx._own_engines, ctx._reset = [], [], set()
    ctx.note = notes.append
    ctx.notes = notes
    return ctx


def test_tests_with_the_same_settings_share_one_engine_and_start_clean(tmp_path):
    STARTED.clear()
    harness = _harness(tmp_path)
    first = _context(harness, tmp_path)
    engine = first.engine_with(max_rank=8)
    engine.load_adapter("left-over", tmp_path)  # a test that loads directly and never unloads
    assert first.engine_with(max_rank=8) is engine and engine.list_adapters() == ["left-over"], \
        "a second acquisition in the same test must not unload the test's own adapters"
    second = _context(harness, tmp_path)
    assert second.engine_with(max_rank=8) is engine and len(STARTED) == 1
    assert engine.list_adapters() == [] and engine.engine_adapters() == [], "the next test saw a left-over adapter"
    second.engine_with(max_rank=16)
    assert len(STARTED) == 2, "other settings need an engine of their own"


def test_an_engine_that_still_reports_adapters_is_replaced(tmp_path):
    STARTED.clear()
    harness = _harness(tmp_path, "ForgetfulEngine")
    first = _context(harness, tmp_path)
    engine = first.engine
    engine.load_adapter("A", tmp_path)
    second = _context(harness, tmp_path)
    fresh = second.engine
    assert fresh is not engine and engine.closed and len(STARTED) == 2
    assert fresh.engine_adapters() == []
    assert any("still reported adapters ['A']" in n for n in second.notes), second.notes


def test_declared_capabilities_decide_before_any_engine_starts(tmp_path):
    STARTED.clear()
    harness = _harness(tmp_path)
    request = SimpleNamespace(node=SimpleNamespace(callspec=None, get_closest_marker=lambda name: None))
    assert harness.missing_capabilities(request, ["prefix_cache", "dynamic_loading"]) == ["prefix_cache"]
    assert STARTED == [], "a capability the class does not declare must not start an engine"


@pytest.mark.parametrize("engine", ["vllm", "openai", "openvino", "builtin"])
def test_declared_capabilities_need_no_engine(engine):
    from lora_conformance.engines.registry import engine_class

    cls = engine_class(engine)
    cfg = cls.parse_args({"api_flavor": "vllm"} if engine == "openai" else {})
    declared = cls.declared_capabilities(cfg, None, "cpu")
    assert declared is None or all(isinstance(c, Capability) for c in declared)


def _decoder_dir(tmp_path: Path) -> Path:
    import json

    d = tmp_path / "llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return d


@pytest.mark.parametrize("engine, same, other", [
    # the built-in engine caches prefixes by default
    ("builtin", {"prefix_cache": "1"}, {"prefix_cache": "0"}),
    # vLLM: prefix caching unset is vLLM's default, on for decoders; cpu has one attention backend
    ("vllm", {"prefix_cache": "1"}, {"prefix_cache": "0"}),
    ("vllm", {"attention_backend": "CPU_ATTN"}, {"max_loras": "2"}),
])
def test_a_value_the_engine_has_by_default_shares_the_default_engine(tmp_path, engine, same, other):
    harness = _harness(tmp_path)
    harness.settings.engine = engine
    model = _decoder_dir(tmp_path)
    default = harness.engine_key(model, "float32", {})
    assert harness.engine_key(model, "float32", same) == default
    assert harness.engine_key(model, "float32", other) != default
    assert harness.engine_key(model, "bfloat16", same) != default


class ResettableEngine(CountingEngine):
    """Empties its prefix cache when asked (``resets``: how often)."""

    resets = 0

    def reset_prefix_cache(self):
        type(self).resets += 1
        return True


@pytest.mark.parametrize("engine, shared", [("ResettableEngine", True), ("CountingEngine", False)])
def test_a_cold_engine_is_the_shared_one_only_where_the_engine_empties_its_cache(tmp_path, engine, shared):
    STARTED.clear()
    ResettableEngine.resets = 0
    harness = _harness(tmp_path, engine)
    warm = _context(harness, tmp_path).engine
    warm.load_adapter("A", tmp_path)
    cold = _context(harness, tmp_path).cold_engine()
    assert (cold is warm) == shared and cold.list_adapters() == []
    assert len(STARTED) == (1 if shared else 2)
    assert ResettableEngine.resets == (1 if shared else 0)


def test_a_served_vllm_caches_prefixes_unless_told_so_the_key_says_so():
    from lora_conformance.engines.openai_engine import OpenAIEngine

    base = {"api_flavor": "vllm", "url": "http://127.0.0.1:1"}
    key = lambda **extra: OpenAIEngine.sharing_key(OpenAIEngine.parse_args({**base, **extra}), None, "cpu")
    assert key() == key(prefix_cache="1")
    assert key() != key(concurrency="4")


def test_a_capability_not_declared_is_shown_with_the_plugins_evidence():
    from lora_conformance.engines.vllm_engine import VllmEngine
    from lora_conformance.outcomes import NotCertified, missing_capabilities

    reasons = VllmEngine.not_declared_reasons(VllmEngine.parse_args({}), None, "cpu")
    assert {c.value for c in reasons} == {"moe", "graphs", "overlap_loading", "eviction_fifo"}
    assert all("vLLM" in why or "vllm/" in why for why in reasons.values())
    with pytest.raises(NotCertified) as info:
        missing_capabilities(["moe", "pinning"], {"moe": "no fused-MoE LoRA on CPU"})
    assert "moe (no fused-MoE LoRA on CPU); pinning" in str(info.value)


class RankLimitedEngine(CountingEngine):
    """Serves ranks up to its max_rank arg, 16 unless asked (vLLM's default), through the standard arg."""

    standard_args = {"max_rank": lambda v: {"max_rank": v}}

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, args)
        from lora_conformance.engines.base import Limits

        self.limits = Limits(4, 8, int(args.get("max_rank", 16)))


class FixedRankEngine(RankLimitedEngine):
    """A limit of 16 and no max_rank arg to raise it."""

    standard_args = {}


def test_a_rank_above_the_default_limit_gets_an_engine_that_allows_it(tmp_path):
    h = _harness(tmp_path, "RankLimitedEngine")
    ctx = _context(h, tmp_path)
    default = ctx.engine
    assert ctx.engine_for_rank(16) is default and default.limits.max_rank == 16
    high = ctx.engine_for_rank(64)
    assert high is not default and high.limits.max_rank == TestContext.HIGH_RANK == 64
    assert ctx.engine_for_rank(32) is high, "the tests of higher ranks share one engine"
    assert ctx.engine_for_rank(128).limits.max_rank == 128
    h.close()


def test_an_engine_that_cannot_raise_its_limit_is_returned_as_it_is(tmp_path):
    h = _harness(tmp_path, "FixedRankEngine")
    ctx = _context(h, tmp_path)
    assert ctx.engine_for_rank(64) is ctx.engine and ctx.engine.limits.max_rank == 16
    h.close()
