"""Values that stop being finite in the engine's dtype, PEFT's regex ``target_modules`` and
pathological ``rank_pattern`` keys: refused with an error naming file and field, or served as PEFT
serves them, and never damaging other requests."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_conformance.adapters import AdapterSpec, synthesize_adapter
from lora_conformance.patterns import PatternError, PatternMatcher
from lora_conformance.adapters.validate import validate_adapter
from lora_conformance.judge.health import assert_healthy, snapshot
from lora_conformance.engines import create_engine
from lora_conformance.engines.base import AdapterFormatError
from lora_conformance.types import GenerationRequest

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory):
    return synthesize_adapter(llama, AdapterSpec(seed=4), tmp_path_factory.mktemp("good") / "a")


def _variant(good: Path, out: Path, config=None, tensors=None) -> Path:
    import shutil

    shutil.copytree(good, out)
    if config is not None:
        cfg = json.loads((out / CONFIG).read_text())
        cfg.update(config)
        (out / CONFIG).write_text(json.dumps(cfg))
    if tensors is not None:
        ts = load_file(str(out / WEIGHTS))
        tensors(ts)
        save_file({k: v.contiguous() for k, v in ts.items()}, str(out / WEIGHTS))
    return out


def _set_first_b(value, dtype=None):
    def edit(ts):
        k = next(k for k in sorted(ts) if k.endswith("lora_B.weight"))
        t = ts[k].to(dtype or ts[k].dtype).clone()
        t.view(-1)[0] = value
        ts[k] = t
    return edit


# ---- non-finite values born in conversion -----------------------------------------------------

POISON = {  # kind -> (config edit, tensor edit, engine dtype, the field the error must name)
    "float64_b_1e300_in_float32": (None, _set_first_b(1e300, torch.float64), "float32", "lora_B.weight"),
    "alpha_1e300": ({"lora_alpha": 1e300}, None, "float32", "lora_alpha"),
    "b_1e5_in_float16": (None, _set_first_b(1e5), "float16", "lora_B.weight"),
    "b_times_scaling_over_float16": (None, _set_first_b(6e4), "float16", "lora_B.weight"),
    "alpha_pattern_1e300": ({"alpha_pattern": {"q_proj": 1e300}}, None, "float32", "alpha_pattern"),
}


@pytest.mark.parametrize("kind", sorted(POISON))
def test_values_not_finite_in_the_compute_dtype_are_refused(llama, good, tmp_path, kind):
    cfg, edit, dtype, field = POISON[kind]
    bad = _variant(good, tmp_path / kind, cfg, edit)
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(bad, llama, 64, dtype)
    assert field in exc.value.field and exc.value.file.startswith(str(bad)), str(exc.value)
    assert dtype in str(exc.value), f"the error should name the engine's dtype {dtype}: {exc.value}"
    if kind == "b_1e5_in_float16":  # finite in float32: accepted there
        validate_adapter(bad, llama, 64, "float32")


@pytest.mark.parametrize("engine_name", ["builtin", "peft"])
@pytest.mark.parametrize("kind", ["float64_b_1e300_in_float32", "alpha_1e300"])
def test_engines_refuse_conversion_poison_and_stay_healthy(llama, good, tmp_path, engine_name, kind):
    cfg, edit, dtype, _ = POISON[kind]
    engine = create_engine(engine_name, llama, "cpu", dtype, {})
    try:
        engine.load_adapter("A", good)
        before = snapshot(engine, prompts=["the old man"], max_new_tokens=3)
        with pytest.raises(AdapterFormatError):
            engine.load_adapter("P", _variant(good, tmp_path / kind, cfg, edit))
        assert_healthy(engine, before, f"refusing {kind}")
    finally:
        engine.close()


def test_builtin_float16_refuses_b_1e5_and_base_rows_stay_finite(llama, good, tmp_path):
    engine = create_engine("builtin", llama, "cpu", "float16", {})
    try:
        engine.load_adapter("A", good)
        with pytest.raises(AdapterFormatError) as exc:
            engine.load_adapter("P", _variant(good, tmp_path / "p", None, _set_first_b(1e5)))
        assert "float16" in str(exc.value)
        outs = engine.generate([GenerationRequest("the old man", None, 3), GenerationRequest("the old man", "A", 3)])
        assert all(math.isfinite(lp) for o in outs for step in o.logprobs for lp in step.values())
    finally:
        engine.close()


def test_runtime_overflow_of_one_adapter_stays_in_its_rows(llama, good, tmp_path):
    """Weights finite in float16 whose delta overflows the activations: only that adapter's rows
    may go non-finite; the base's and another adapter's rows in the same batch are untouched."""
    def big(ts):
        for k in ts:
            ts[k] = torch.full_like(ts[k], 30.0)
    engine = create_engine("builtin", llama, "cpu", "float16", {})
    try:
        engine.load_adapter("A", good)
        alone = engine.generate([GenerationRequest("the old man", None, 3), GenerationRequest("the old man", "A", 3)])
        engine.load_adapter("X", _variant(good, tmp_path / "x", None, big))
        mixed = engine.generate([GenerationRequest("the old man", None, 3), GenerationRequest("the old man", "X", 3),
                                 GenerationRequest("the old man", "A", 3)])
        overflowed = [lp for step in mixed[1].logprobs for lp in step.values()]
        assert not all(math.isfinite(lp) for lp in overflowed) or mixed[1].token_ids != alone[0].token_ids, \
            "the probe adapter should overflow (or at least change) its own rows"
        for got, want in ((mixed[0], alone[0]), (mixed[2], alone[1])):
            assert got.token_ids == want.token_ids
            assert all(math.isfinite(lp) for step in got.logprobs for lp in step.values())
    finally:
        engine.close()


# ---- regex target_modules (PEFT: a string is re.fullmatch on the module name) ---------------

@pytest.mark.parametrize("pattern,needle", [
    (r".*", "LoRA cannot wrap"),  # PEFT: ValueError "Target module LlamaModel(...) is not supported"
    (r"^nomatch$", "matches no module"),  # PEFT: NoMatchingPeftModuleError
    (r"q_proj", "matches no module"),  # fullmatch: a bare suffix matches nothing (PEFT refuses too)
    (r".*\.q_proj", "PEFT would ignore"),  # v_proj tensors present but not targeted
    (r"(.*.*)*z", "matches no module"),  # catastrophic for re: bounded here
])
def test_regex_target_modules_refused_where_peft_refuses(llama, good, tmp_path, pattern, needle):
    bad = _variant(good, tmp_path / "r", {"target_modules": pattern})
    t0 = time.monotonic()
    with pytest.raises(AdapterFormatError) as exc:
        validate_adapter(bad, llama, 64)
    assert time.monotonic() - t0 < 1.0
    assert needle in str(exc.value), str(exc.value)
    assert exc.value.field in ("target_modules",) or exc.value.field.endswith(".lora_A.weight"), exc.value.field


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.[qv]_proj"])
def test_regex_target_modules_served_as_peft_serves_them(llama, good, tmp_path, pattern):
    d = _variant(good, tmp_path / "ok", {"target_modules": pattern})
    reqs = [GenerationRequest(p, "R", 6) for p in ("the old man", "a cat sat on")] + [GenerationRequest("the old man")]
    outs = {}
    for name in ("builtin", "peft"):
        engine = create_engine(name, llama, "cpu", "float32", {})
        try:
            engine.load_adapter("R", d)
            outs[name] = engine.generate(reqs)
        finally:
            engine.close()
    ref = outs["peft"]
    for got, want in zip(outs["builtin"], ref):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            common = set(a) & set(b)
            assert common and max(abs(a[k] - b[k]) for k in common) < 1e-3
    # and the adapter matters: the same tensors under the list form give the same outputs
    listed = create_engine("builtin", llama, "cpu", "float32", {})
    try:
        listed.load_adapter("R", good)
        assert [o.token_ids for o in listed.generate(reqs)] == [o.token_ids for o in outs["builtin"]]
    finally:
        listed.close()


# ---- rank_pattern / alpha_pattern keys that backtrack --------------------------------------

@pytest.fixture(scope="module")
def builtin32(llama):
    engine = create_engine("builtin", llama, "cpu", "float32", {})
    yield engine
    engine.close()


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
@pytest.mark.parametrize("key,outcome", [(r"(.*.*)*z", "loaded"), (r".*.*.*.*.*.*.*.*.*.*.*.*z", "loaded"),
                                         (r"(.*){1,300}[bc]", "refused")])
def test_pathological_pattern_keys_load_or_are_refused_within_a_second(llama, good, builtin32, tmp_path, field,
                                                                        key, outcome):
    """Python's re (PEFT's) runs past 10 s on each of these keys against a module name."""
    d = _variant(good, tmp_path / "p", {field: {key: 4 if field == "rank_pattern" else 3.0}})
    t0 = time.monotonic()
    try:
        builtin32.load_adapter("P", d)
        got = "loaded"
        builtin32.unload_adapter("P")
    except AdapterFormatError as exc:
        got = "refused"
        assert exc.field.startswith(field) and "catastrophic backtracking" in exc.problem, str(exc)
    took = time.monotonic() - t0
    assert took < 1.0 + 0.5, f"{key!r}: {took:.2f} s ({got})"  # the 1 s budget plus the load itself
    assert got == outcome


def test_matcher_budget_refuses_a_pattern_the_regex_engine_cannot_finish(monkeypatch):
    m = PatternMatcher(budget_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(PatternError, match="catastrophic backtracking"):
        m.pattern_key({r"(.*){1,300}[bc]": 4}, "model.layers.0.self_attn.q_proj")
    assert time.monotonic() - t0 < 1.0
    assert m.pattern_key({r"q_proj": 4, r".*": 2}, "model.layers.0.self_attn.q_proj") == "q_proj"
    assert m.target_matches(r".*\.q_proj", "model.layers.0.self_attn.q_proj")
    assert not m.target_matches(r"q_proj", "model.layers.0.self_attn.q_proj")


# ---- a 4 GiB weights file is refused from its header, before its data is read ----------------

def test_a_4gib_weights_file_is_refused_from_its_header(llama, good, tmp_path):
    import resource

    from lora_conformance.adapters.malformed import header_overruns_file

    bad = header_overruns_file(good, tmp_path / "huge", 64)
    assert (bad / WEIGHTS).stat().st_size > 4 << 30
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(AdapterFormatError, match="does not fit the base model"):
        validate_adapter(bad, llama, 64)
    assert time.monotonic() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 256 * 1024  # KiB: nothing like 4 GiB read
