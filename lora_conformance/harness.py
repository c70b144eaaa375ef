"""Session services behind the plugin's fixtures: models, adapters, references, engines.

``Harness`` lives for the session (one per pytest process). ``TestContext`` is what a suite
test sees as the ``lora`` fixture: the test's base model and dtype, engines for it, the
adapters it loaded (unloaded again at teardown, so tests do not leak state into each
other), the reference, and comparison helpers that apply the dtype's tolerance.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import pytest

from lora_conformance import paired_effects
from lora_conformance.markers import base_model_kind
from lora_conformance.paired_effects import Alternatives
from lora_conformance.settings import Settings, get_settings
from lora_conformance.types import GenerationRequest, GenerationResult

# The feature that certifies prompt logprobs; other tests use them only where a probe shows them
# working (TestContext.prompt_logprobs_shown_to_work).
PROMPT_LOGPROBS_FEATURE = "accuracy/prefill_logprobs_with_adapter"
# How long an xdist worker waits for another worker's probe answer before probing itself (s).
SHARED_PROBE_WAIT = 900
# Engines kept alive at once (least recently used closed first, the run's own engine last): each
# settings combination a suite asks for keeps its engine, so the next test with those settings
# starts none.
MAX_LIVE_ENGINES = 3
MODEL_KINDS = {"decoder": None, "llama": None, "moe": "synthetic:moe", "encoder": "synthetic:encoder",
               # base-model variants (suites/test_base_models.py): always these synthetic models
               "llama-hd128": "synthetic:llama-hd128", "llama-hd256": "synthetic:llama-hd256",
               "qwen2": "synthetic:qwen2"}


HARNESS_KEY = pytest.StashKey["Harness"]()


def session_harness(config: pytest.Config, environment: dict) -> "Harness":
    """This process's harness, made on first use, filling ``environment`` (the facts the report
    records about the engine)."""
    if HARNESS_KEY not in config.stash:
        from lora_conformance import parallel

        # Before the first engine or reference: a worker gets its share of the cores.
        parallel.apply_thread_share(get_settings(config).threads)
        config.stash[HARNESS_KEY] = Harness(get_settings(config), environment)
    return config.stash[HARNESS_KEY]


def existing_harness(config: pytest.Config) -> Optional["Harness"]:
    """This process's harness, or None where no test has asked for one yet."""
    return config.stash.get(HARNESS_KEY, None)


class Harness:
    def __init__(self, settings: Settings, environment: Optional[dict] = None):
        self.settings = settings
        # Filled with what only a live engine knows (version, capabilities, limits), for the report.
        self.environment = environment if environment is not None else {}
        self._model_dirs: dict[str, Path] = {}
        self._kinds: dict[Path, str] = {}
        self._references: dict[Path, Any] = {}
        self._engines: "OrderedDict[tuple, Any]" = OrderedDict()
        self._engine_failures: dict[tuple, BaseException] = {}
        self._engine_extra: dict[tuple, dict] = {}  # shared engine key -> the test's args it was started with
        self._declared: dict[Path, Any] = {}  # model dir -> the engine class's declared capabilities
        # Engine starts not yet attached to a test (the plugin's makereport takes them, take_starts),
        # and why each shared engine that was started before is gone (its next start says so).
        self._starts: list[dict] = []
        self._n_starts = 0  # this process's starts so far (numbers them)
        self._gone: dict[tuple, str] = {}
        self.prompt_logprobs_probes: dict[tuple, str] = {}  # (model, dtype) -> '' or what broke
        self._closing: list[Any] = []  # threads closing retired engines (cpu), joined by close()
        self._uses: set[str] = set()  # shared engines other than the run's own asked for since take_uses
        self._own: Optional[tuple] = None  # _own_key's answer
        self._close_errors: list[BaseException] = []
        from lora_conformance.adapters import validate
        from lora_conformance.models import tokenizer

        validate.shapes_cache_dir = settings.cache_dir / "shapes"
        tokenizer.resolution_cache_dir = settings.cache_dir / "tokenizers"

    # ---- models and adapters ---------------------------------------------------------

    def model_spec(self, kind: Optional[str]) -> str:
        """``--base-model`` unless the suite needs another kind (moe, encoder) than it is."""
        if kind in (None, "decoder", "llama"):
            return self.settings.base_model
        if kind not in MODEL_KINDS:
            raise ValueError(f"unknown base_model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
        own = self.model_dir(self.settings.base_model)
        from lora_conformance.models import profiles  # the profile's model for the kind (moe), else the table's

        other = profiles.model_for(profiles.get(self.settings.profile), kind) or MODEL_KINDS[kind]
        return self.settings.base_model if self.model_kind(own) == kind else other

    def model_dir(self, spec: str) -> Path:
        if spec not in self._model_dirs:
            from lora_conformance.models import resolve_base_model

            self._model_dirs[spec] = resolve_base_model(spec, self.settings.cache_dir / "models")
        return self._model_dirs[spec]

    def model_kind(self, model_dir: Path) -> str:
        if model_dir not in self._kinds:
            from lora_conformance.checkpoints import model_kind

            self._kinds[model_dir] = model_kind(model_dir)
        return self._kinds[model_dir]

    def adapter_path(self, model_dir: Path, spec) -> Path:
        from lora_conformance.adapters import synthesize_cached

        return synthesize_cached(model_dir, spec, self.settings.cache_dir / "adapters")

    def reference(self, model_dir: Path):
        if model_dir not in self._references:
            from lora_conformance.reference import ReferenceCache, ReferenceRunner

            s = self.settings
            cache = ReferenceCache(s.cache_dir / "references", refresh=s.refresh_references)
            self._references[model_dir] = ReferenceRunner(model_dir, s.reference_device, s.reference_dtype, cache)
        return self._references[model_dir]

    # ---- engines ---------------------------------------------------------------------

    def engine_args(self, extra: Mapping[str, Any]) -> dict[str, str]:
        # The user's --engine-arg values first; a test's own requirements win.
        return {**self.settings.engine_args, **{k: str(v) for k, v in extra.items()}}

    def create_engine(self, model_dir: Path, dtype: str, extra: Mapping[str, Any], why: str = "fresh engine"):
        """A new engine; an engine that refuses to start with this model, dtype or these args
        (UnsupportedFeatureError) makes the test *not certified* (cause ``refused``), not failed.
        The start (its seconds and ``why``) goes to the report with the test that caused it."""
        import time

        from lora_conformance.engines import UnsupportedFeatureError, create_engine
        from lora_conformance.outcomes import REFUSED, not_certified

        args = self.engine_args(extra)
        shown = ", ".join(f"{k}={v}" for k, v in sorted(args.items())) or "no engine args"
        started = time.perf_counter()
        try:
            return create_engine(self.settings.engine, model_dir, self.settings.device, dtype, args)
        except UnsupportedFeatureError as exc:
            why += "; refused to start"
            not_certified(REFUSED, f"engine {self.settings.engine!r} refused to start ({model_dir.name}, {dtype}, "
                                   f"{shown}): {exc}")
        except BaseException:
            why += "; failed to start"
            raise
        finally:
            self._starts.append({"engine": f"{model_dir.name}, {dtype}, {shown}",
                                 "seconds": round(time.perf_counter() - started, 2), "why": why,
                                 "n": self._n_starts})
            self._n_starts += 1

    def take_starts(self) -> list[dict]:
        """The engine starts since the last call (the plugin attaches them to the running test)."""
        taken, self._starts = self._starts, []
        return taken

    def take_uses(self) -> list[str]:
        """The shared engines other than the run's own that were asked for since the last call, as
        stable labels (model name, dtype, effective settings): the plugin hands them to the
        controller, which keeps them beside the durations, so that the next run under ``--dist
        loadfile`` sends files that share such an engine to one worker (``run_order.file_groups``)."""
        taken, self._uses = sorted(self._uses), set()
        return taken

    def _own_key(self) -> Optional[tuple]:
        """The run's own engine's key (its model, dtype and the user's args), computed once."""
        if self._own is None:
            try:
                self._own = self.engine_key(self.model_dir(self.model_spec(None)), self.settings.dtype, {})
            except Exception:  # noqa: BLE001 - a base model that does not resolve has no engine to keep
                return None
        return self._own

    def engine_key(self, model_dir: Path, dtype: str, extra: Mapping[str, Any]) -> tuple:
        """What identifies a shared engine: the model, the dtype and the engine's *effective*
        settings (``Engine.sharing_key`` of the parsed args), so that a test asking for a value
        the engine has anyway (``prefix_cache=1`` where caching is the default) shares the engine
        started without it. Args that do not parse keep their raw strings: create_engine then
        reports the problem, once."""
        args = self.engine_args(extra)
        try:
            cls, cfg = self.parsed_engine_args(args)
            ident = cls.sharing_key(cfg, model_dir, self.settings.device)
        except Exception:  # noqa: BLE001 - any parse problem is create_engine's to report
            ident = tuple(sorted(args.items()))
        return (str(model_dir), dtype, ident)

    def parsed_engine_args(self, args: Mapping[str, str]):
        """(the engine class, its parsed ``Args``) for these engine args; parse errors propagate."""
        from lora_conformance.engines import engine_class

        cls = engine_class(self.settings.engine)
        return cls, cls.parse_args(args, self.settings.sources.get("engine_arg", "command line"))

    def shared_engine(self, model_dir: Path, dtype: str, extra: Mapping[str, Any] = {}):
        """An engine shared by the tests that ask for the same model, dtype and effective settings."""
        key = self.engine_key(model_dir, dtype, extra)
        if key != self._own_key():
            self._uses.add(f"{Path(key[0]).name}, {key[1]}, {key[2]}")
        if key in self._engine_failures:
            raise self._engine_failures[key]
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= MAX_LIVE_ENGINES:
            old_key = self._eviction_victim()
            old = self._engines.pop(old_key)
            self._gone[old_key] = f"closed for a newer engine (at most {MAX_LIVE_ENGINES} live)"
            self.retire(old)
        from lora_conformance.outcomes import NotCertified

        why = f"shared engine, started again: {self._gone[key]}" if key in self._gone else "shared engine, first use"
        try:
            engine = self.create_engine(model_dir, dtype, extra, why)
        except (Exception, NotCertified) as exc:  # NotCertified is a pytest skip, a BaseException
            self._engine_failures[key] = exc  # do not retry a failing start (or a refusal) for every test
            raise
        self._engines[key] = engine
        self._engine_extra[key] = dict(extra)
        self._record(engine)
        return engine

    def _eviction_victim(self) -> tuple:
        """The shared engine to close for a new one: the least recently used, but the run's own
        engine (the run's model, dtype and the user's args, which most tests use) only when every
        live engine is one."""
        own = self._own_key()
        return next((k for k in self._engines if k != own), next(iter(self._engines)))

    def retire(self, engine, swallow: bool = False) -> None:
        """Close an engine the run no longer uses. On cpu the close runs on a thread of its own
        while the next test goes on: a vLLM engine takes about 4.5 s to stop, almost all of it
        waiting for its processes to exit (no cpu), and a certification closes one or two dozen.
        The thread is no daemon, and ``close`` (the session's end, an interrupted run's too) joins
        every one and raises the first close error. On an accelerator the close finishes first, so
        that the next engine finds the device memory free. ``swallow``: the engine may be dead,
        its close failing is no news."""
        from lora_conformance import devices

        if devices.device_type(self.settings.device) == devices.CPU:
            self._close_on_thread(engine, swallow)
            return
        self._close(engine, swallow)
        if self._close_errors:
            raise self._close_errors.pop(0)

    def _close(self, engine, swallow: bool = False) -> None:
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - raised by close(), or by retire on an accelerator
            if not swallow:
                self._close_errors.append(exc)

    def _close_on_thread(self, engine, swallow: bool = False) -> None:
        import threading

        thread = threading.Thread(target=self._close, args=(engine, swallow), name=f"close {type(engine).__name__}",
                                  daemon=False)
        thread.start()
        self._closing.append(thread)

    def _record(self, engine) -> None:
        if "engine" not in self.environment:
            self.environment["engine"] = {
                "version": engine.version(),
                "capabilities": sorted(c.value for c in engine.capabilities),
                "limits": dataclasses.asdict(engine.limits),
            }
            settings = getattr(engine, "settings", None)
            if callable(settings):
                # Every effective engine setting, and where ours differ from the engine's defaults.
                self.environment["engine"]["settings"] = settings()

    def reset_adapters(self, engine, note=None):
        """Before a test uses a shared engine: unload every adapter, then ask the engine itself
        (``engine_adapters``) that none is left, so that an adapter loaded by an earlier test can
        never make this one pass. An engine that still reports adapters is replaced by a fresh one
        (``note`` says so in the report); the unload suites judge that behaviour themselves.
        Returns the engine the test must use."""
        from lora_conformance.engines.base import EngineError

        leftover: list[str] = []
        try:
            for name in list(engine.list_adapters()):
                engine.unload_adapter(name)
            leftover = list(engine.list_adapters()) + list(engine.engine_adapters() or [])
        except EngineError as exc:
            leftover = [f"(reset failed: {type(exc).__name__}: {exc})"]
        if not leftover:
            return engine
        key = next((k for k, e in self._engines.items() if e is engine), None)
        if key is None:
            raise AssertionError(f"the engine still reports adapters {leftover} after unloading every adapter")
        del self._engines[key]
        try:
            self.retire(engine, swallow=True)
        except Exception:  # noqa: BLE001 - it is dropped either way
            pass
        if note is not None:
            note(f"the shared engine still reported adapters {leftover} after unloading every adapter; "
                 "this test ran on a fresh engine")
        fresh = self.create_engine(Path(key[0]), key[1], self._engine_extra[key],
                                   "shared engine replaced: it still reported adapters after unloading every one")
        self._engines[key] = fresh
        return fresh

    def missing_capabilities(self, request: pytest.FixtureRequest, needed: Iterable[str]) -> list[str]:
        """The capabilities in ``needed`` the engine does not declare for this test's model and the user's
        args. The engine class answers without starting anything; only where it cannot tell (None) is
        the shared engine started and asked."""
        from lora_conformance.engines.base import Capability

        model_dir = self.model_dir(self.model_spec(base_model_kind(request.node)))
        declared = self.declared_capabilities(model_dir)
        if declared is None:
            # A refusal to start with this model (UnsupportedFeatureError) is raised as not certified.
            declared = self.shared_engine(model_dir, _item_dtype(request, self.settings)).capabilities
        return [c for c in needed if Capability.parse(c) not in declared]

    def not_declared_reasons(self, request: pytest.FixtureRequest) -> dict[str, str]:
        """capability name -> why the engine does not declare it for this test's model
        (``Engine.not_declared_reasons``)."""
        model_dir = self.model_dir(self.model_spec(base_model_kind(request.node)))

        try:
            cls, cfg = self.parsed_engine_args(self.settings.engine_args)
            reasons = cls.not_declared_reasons(cfg, model_dir, self.settings.device)
        except Exception:  # noqa: BLE001 - the reasons only explain; the verdict stands without them
            return {}
        return {getattr(c, "value", str(c)): why for c, why in reasons.items()}

    def declared_capabilities(self, model_dir: Path):
        """The engine class's own answer (``Engine.declared_capabilities``) for the user's engine args,
        or None where only a started engine can tell."""
        if model_dir not in self._declared:
            from lora_conformance.engines.args import class_capabilities

            cls, cfg = self.parsed_engine_args(self.settings.engine_args)
            self._declared[model_dir] = class_capabilities(cls, cfg, model_dir, self.settings.device)
        return self._declared[model_dir]

    def discard_engines(self) -> None:
        """Close every shared engine: after an EngineFailure one may be dead, and a dead engine
        must fail only the test that broke it, not every test after it."""
        while self._engines:
            key, engine = self._engines.popitem()
            self._gone[key] = "closed after an engine failure"
            self.retire(engine, swallow=True)  # closing a dead engine may fail too; it is dropped either way

    def close(self) -> None:
        """Close every engine, the live ones side by side (each close waits for its own processes),
        and wait for the closes ``retire`` started; the first close error is raised once every
        engine had its close."""
        while self._engines:
            self._close_on_thread(self._engines.popitem()[1])
        while self._closing:
            self._closing.pop(0).join()
        if self._close_errors:
            raise self._close_errors.pop(0)

def _item_dtype(request: pytest.FixtureRequest, settings: Settings) -> str:
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "dtype" in callspec.params:
        return callspec.params["dtype"]
    return settings.dtype


# ---- the engine's declared limits ------------------------------------------------------


def tests_eviction(node: pytest.Item) -> bool:
    """The test certifies eviction past ``max_loaded_loras`` (it requires ``max_loaded``): loading
    more adapters than the engine holds is then the point, not a mistake."""
    from lora_conformance.features import required_capabilities

    return "max_loaded" in required_capabilities(node)


def check_loaded_limit(engine, needed: int, evicting: bool = False) -> None:
    """Not certified (outcomes.LIMIT) when a test needs more adapters loaded at once than the
    engine's declared ``max_loaded_loras``: on such an engine the test would fail for its own
    reason, not the engine's. ``evicting``: the test is about evicting past the limit."""
    from lora_conformance.outcomes import limit_too_small

    allowed = engine.limits.max_loaded_loras
    if needed > allowed and not evicting:
        limit_too_small("loaded adapters", needed, allowed)


AdapterRef = Union[str, Path, Any]  # a DEFAULT_ADAPTERS name, a PEFT directory, or an AdapterSpec


def _adapter_names(labels: Sequence[Optional[str]]) -> list[str]:
    """The adapters of a batch's labels (None: a base row), each once, in order."""
    return [n for n in dict.fromkeys(labels) if n]


class TestContext:
    """The ``lora`` fixture."""

    __test__ = False  # not a pytest test class

    def __init__(self, harness: Harness, request: pytest.FixtureRequest):
        self.harness = harness
        self.settings = harness.settings
        self.request = request
        self.dtype = _item_dtype(request, self.settings)
        self.device = self.settings.device
        self.model_dir = harness.model_dir(harness.model_spec(base_model_kind(request.node)))
        self._loaded: list[tuple[Any, str]] = []
        self._own_engines: list[Any] = []
        self._reset: set[int] = set()  # shared engines this test has reset already

    # ---- engines -----------------------------------------------------------------------

    @property
    def engine(self):
        """The shared engine for this test's model and dtype, with the user's engine args; no
        adapter is loaded in it when the test first gets it."""
        return self.engine_with()

    def declares(self, capability: str) -> bool:
        """Whether the engine under test declares ``capability`` for this test's model: the engine
        class answers where it can (nothing starts), else the shared engine."""
        return not self.harness.missing_capabilities(self.request, [capability])

    def require(self, *capabilities: str) -> None:
        """Not certified unless the engine declares every one of ``capabilities`` for this test's
        model; the report shows the plugin's evidence for each one it does not declare (what a
        feature marker's ``requires`` does, for a capability only a parametrisation needs)."""
        from lora_conformance.outcomes import missing_capabilities

        missing = self.harness.missing_capabilities(self.request, capabilities)
        if missing:
            missing_capabilities(missing, self.harness.not_declared_reasons(self.request))

    def engine_with(self, **args):
        """A shared engine with these engine args on top of the user's (started once per
        process for a model, dtype and args); no adapter is loaded in it when the test first
        gets it (Harness.reset_adapters)."""
        engine = self.harness.shared_engine(self.model_dir, self.dtype, args)
        if id(engine) not in self._reset:
            engine = self.harness.reset_adapters(engine, self.note)
            self._reset.add(id(engine))
        return engine

    # The highest adapter rank a test asks of a shared engine (adapter_semantics/rank at 64): an
    # engine whose default limit is lower (vLLM's 16) is asked for this limit, so those tests share
    # one engine.
    HIGH_RANK = 64

    def engine_for_rank(self, rank: int):
        """The shared engine when it accepts adapters of ``rank``; else the shared engine with the
        standard arg ``max_rank`` raised to ``max(rank, HIGH_RANK)``, as a user serving such
        adapters raises the limit. An engine without a ``max_rank`` arg, or whose own limit the
        user set explicitly (an engine's own arg wins over a standard one), is returned as it is:
        its ``limits.max_rank`` then tells the test what it cannot serve."""
        engine = self.engine
        if rank <= engine.limits.max_rank:
            return engine
        cls, _ = self.harness.parsed_engine_args({})
        if "max_rank" not in (cls.standard_args or {}):
            # an engine whose own arg is named max_rank (the builtin's) is raised the same way, unless
            # the user set it
            from lora_conformance.engines.args import arg_specs

            own = {s.name for s in arg_specs(cls.Args)} if getattr(cls, "Args", None) else set()
            if "max_rank" not in own or "max_rank" in self.harness.settings.engine_args:
                return engine
        return self.engine_with(max_rank=max(rank, self.HIGH_RANK))

    # The one small capacity of every test about slot limits (pinning, eviction, more adapters than
    # slots): two adapters per batch, four held. One setting, so these tests share one engine (an
    # engine that starts in half a minute, vLLM's on cpu, starts it once per worker, not once per
    # test); each test sizes its adapters to it (more than the slots, more than the held ones).
    CAPACITY = {"max_loras_per_batch": 2, "max_loaded_loras": 4}

    def capacity_engine(self, **args):
        """The shared engine with ``CAPACITY`` (and ``args``) on top of the user's engine args."""
        return self.engine_with(**self.CAPACITY, **args)

    def cold_engine(self, **args):
        """An engine with these args, no adapter loaded and an empty prefix cache: the shared one
        when the engine can empty its cache itself (``Engine.reset_prefix_cache``), else a fresh
        one for this test alone."""
        engine = self.engine_with(**args)
        if engine.reset_prefix_cache():
            return engine
        return self.fresh_engine(**args)

    def fresh_engine(self, **args):
        """A new engine for this test alone (closed at teardown): for a test that needs an engine
        that has never served anything (cold caches, a baseline untouched by adapters)."""
        engine = self.harness.create_engine(self.model_dir, self.dtype, args, "a fresh engine for this test")
        self._own_engines.append(engine)
        return engine

    def release(self, engine) -> None:
        """Close one of this test's own engines now (``fresh_engine``), before the test ends: on an
        accelerator the close finishes first (the next engine finds the device memory free), on cpu
        it runs on a thread while the test goes on (``Harness.retire``)."""
        self._own_engines.remove(engine)
        self._loaded = [(e, name) for e, name in self._loaded if e is not engine]  # nothing to unload at the end
        self.harness.retire(engine)

    # ---- adapters ----------------------------------------------------------------------

    def adapter_path(self, ref: AdapterRef) -> Path:
        from lora_conformance.adapters import DEFAULT_ADAPTERS

        if isinstance(ref, Path):
            return ref
        if isinstance(ref, str):
            if ref not in DEFAULT_ADAPTERS:
                raise KeyError(f"no default adapter {ref!r}; defaults: {', '.join(DEFAULT_ADAPTERS)}")
            ref = DEFAULT_ADAPTERS[ref]
        return self.harness.adapter_path(self.model_dir, ref)

    def load(self, engine, name: str, ref: Optional[AdapterRef] = None, pinned: bool = False) -> Path:
        """Load adapter ``ref`` (default: the default adapter called ``name``) as ``name``.
        Past the engine's ``max_loaded_loras`` the test is not certified (check_loaded_limit)."""
        path = self.adapter_path(name if ref is None else ref)
        self.require_loaded(engine, len(set(engine.list_adapters()) | {name}))
        engine.load_adapter(name, path, pinned=pinned)
        self._loaded.append((engine, name))
        return path

    def require_loaded(self, engine, needed: int) -> None:
        """The test needs ``needed`` adapters loaded at once on ``engine``: not certified when
        the engine holds fewer, unless the test is about eviction past that limit."""
        check_loaded_limit(engine, needed, tests_eviction(self.request.node))

    # ---- requests, references, comparisons ---------------------------------------------

    @property
    def prompts(self) -> list[str]:
        from lora_conformance.models import default_prompts

        return default_prompts()

    def requests(self, adapters: Sequence[Optional[str]], prompts: Optional[Sequence[str]] = None,
                 max_new_tokens: int = 16, prompt_logprobs: bool = False, top_k: int = 5) -> list[GenerationRequest]:
        """One request per adapter label (None = base), prompts taken in turn."""
        ps = list(prompts or self.prompts)
        return [GenerationRequest(prompt=ps[i % len(ps)], adapter=a, max_new_tokens=max_new_tokens,
                                  top_k=top_k, prompt_logprobs=prompt_logprobs) for i, a in enumerate(adapters)]

    def reference(self, requests: Sequence[GenerationRequest],
                  adapters: Mapping[str, AdapterRef] = {}) -> list[GenerationResult]:
        """Isolated HF+PEFT outputs; ``adapters`` maps request adapter names to their refs
        (names absent from it are taken from DEFAULT_ADAPTERS)."""
        names = {r.adapter for r in requests if r.adapter is not None}
        paths = {n: self.adapter_path(adapters.get(n, n)) for n in names}
        return self.harness.reference(self.model_dir).generate(requests, paths)

    def decode(self, token_id: int) -> str:
        return self.harness.reference(self.model_dir).decode_token(token_id)

    def prompt_of_tokens(self, n: int) -> Optional[str]:
        """A prompt of the default prompts' words that the reference makes exactly ``n`` prompt tokens
        (special tokens included), or None where no run of their words has that count."""
        runner = self.harness.reference(self.model_dir)
        for prompt in self.prompts[5:] + self.prompts[:5]:
            words = " ".join([prompt] + self.prompts).split()
            for end in range(1, len(words) + 1):
                text = " ".join(words[:end])
                count = runner.token_count(text)
                if count == n:
                    return text
                if count > n:
                    break
        return None

    @property
    def tolerance(self):
        from lora_conformance.compare import tolerance_for

        return tolerance_for(self.dtype)

    def assert_adapter_visible(self, references: Sequence[GenerationResult], requests: Sequence[GenerationRequest],
                               label: str = "", factor: float = 2.0,
                               others: Optional[Sequence[GenerationResult]] = None, tolerance=None) -> None:
        """The test's own power: the references with the adapters must differ from the base model's
        (same prompts, no adapter; or from ``others``, outputs an engine with the bug under test
        would give) by more than ``factor`` x this dtype's tolerance somewhere, or an engine that
        drops the adapter would pass. ``tolerance``: the one the test compares with (default the
        dtype's). Raises AssertionError naming the test's setup."""
        from dataclasses import replace

        from lora_conformance.compare import ConformanceAssertionError, assert_logprobs_close

        tol = tolerance or self.tolerance
        wide = replace(tol, prompt_rms_max=factor * tol.prompt_rms_max, free_running_atol=factor * tol.free_running_atol,
                       decode_atol=factor * tol.decode_atol, tie_margin=factor * tol.tie_margin)
        if others is None:
            others = self.reference([replace(r, adapter=None) for r in requests])
        for ref, base in zip(references, others):
            try:
                assert_logprobs_close(ref, base, wide, decode=self.decode)
            except ConformanceAssertionError:
                return  # visible
        raise AssertionError(
            f"{label}: the adapters' effect on the reference is within {factor} x the {tol.dtype} tolerance "
            f"(prompt rms {tol.prompt_rms_max}, decode {tol.decode_atol}) for every request: this test could not tell "
            "an engine that ignores them from a correct one (suite defect: strengthen the adapter)")

    def note(self, text: str) -> None:
        """A remark the report shows beside this test's verdict (what the test could not establish)."""
        from lora_conformance import evidence

        evidence.add(self.request.node, evidence.NOTE, text)

    def prompt_logprobs_shown_to_work(self, engine) -> bool:
        """Whether this test may ask ``engine`` (the one under test) for prompt logprobs, a feature it
        does not certify (``PROMPT_LOGPROBS_FEATURE`` does): the engine declares them, and a probe on
        an engine of its own, once per process, got answers that match the reference. Otherwise the
        test checks what it can without them and the report notes the weaker check: a bug of prompt
        logprobs turns only their own feature red. The probe decides, never another test's outcome
        nor the expectations file (expectations say how an outcome is reported, never which checks
        run), so the answer is the same in every worker, every order and every expectations file."""
        if not engine.supports("prompt_logprobs"):
            self.note("without prompt_logprobs (the engine does not declare it): a weaker check")
            return False
        key = (str(self.model_dir), self.dtype)
        if key not in self.harness.prompt_logprobs_probes:
            self.harness.prompt_logprobs_probes[key] = self._run_shared(key, self._probe_prompt_logprobs)
        broken = self.harness.prompt_logprobs_probes[key]
        if broken:
            self.note(f"without prompt_logprobs: {broken}; a weaker check ({PROMPT_LOGPROBS_FEATURE} certifies them)")
        return not broken

    def _run_shared(self, key: tuple, probe) -> str:
        """``probe()``'s answer, computed once per run: under pytest-xdist the first worker to ask
        computes it and the others read its answer (a file in the run's temporary directory), so a
        probe that starts an engine starts one per run, not one per worker."""
        config = self.request.config
        if not hasattr(config, "workerinput"):
            return probe()
        import hashlib
        import json
        import os
        import time

        run_dir = self.request.getfixturevalue("tmp_path_factory").getbasetemp().parent / "lora-shared-probes"
        run_dir.mkdir(exist_ok=True)
        stem = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        answer, lock = run_dir / f"{stem}.json", run_dir / f"{stem}.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            deadline = time.monotonic() + SHARED_PROBE_WAIT
            while not answer.exists():
                try:
                    owner = int(lock.read_text() or 0)
                    if owner:
                        os.kill(owner, 0)  # the worker computing it is still there
                except (OSError, ValueError):  # the lock is gone (given up) or its worker died
                    if not answer.exists():
                        return probe()
                if time.monotonic() > deadline:
                    return probe()
                time.sleep(0.2)
            return json.loads(answer.read_text())["answer"]
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            result = probe()
        except BaseException:
            lock.unlink(missing_ok=True)  # interrupted: a waiting worker asks for itself
            raise
        tmp = answer.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"answer": result}))
        os.replace(tmp, answer)
        return result

    def _probe_prompt_logprobs(self) -> str:
        """'' when a mixed batch (adapter A and base rows) with prompt logprobs, on an engine of its
        own, matches the reference; else what went wrong."""
        try:
            engine = self.harness.create_engine(self.model_dir, self.dtype, {},
                                                "the prompt-logprobs probe's own engine")
        except Exception as exc:  # noqa: BLE001 - any start failure means: do not rely on the probe
            return f"the probe engine did not start ({type(exc).__name__})"
        try:
            engine.load_adapter("A", self.adapter_path("A"))
            reqs = self.requests(["A", None], max_new_tokens=2, prompt_logprobs=True)
            outs = engine.generate(reqs)
            if any(o.prompt_logprobs is None for o in outs):
                return "a probe with prompt logprobs returned none"
            self.assert_matches_reference(outs, self.reference(reqs), reqs, label="prompt-logprobs probe")
            return ""
        except Exception as exc:  # noqa: BLE001 - the probe's only question: does it work?
            return f"a probe with prompt logprobs failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        finally:
            self.harness.retire(engine, swallow=True)

    def assert_conforms(self, engine, labels: Sequence[Optional[str]], adapters: Mapping[str, AdapterRef] = {},
                        prompts: Optional[Sequence[str]] = None, *,
                        alternatives: Alternatives = Alternatives(), label: str = "") -> list:
        """The paired, teacher-forced verdict (``lora_conformance.paired_effects``), then the free-running
        decode check. For each adapter label the engine's effect (adapter minus base, both from the
        engine) must match the reference's and be nearest the correct hypothesis among the alternatives
        (``adapter_hypotheses.standard``, "served as" each other adapter of the test, and what
        ``alternatives`` adds). Requests are made in the order of ``labels`` (None = a base row),
        prompts taken in turn, so a test's batch composition is what the engine sees; ``adapters``
        maps labels to their refs (others are default adapters). Every alternative must be separable
        at this dtype (else a suite defect), except single modules dropped, which only
        ``Alternatives(modules=True)`` tests must separate (elsewhere they are judged where separable
        and reported otherwise). Returns the analyses; raises SuiteDefectError when the test cannot
        separate a hypothesis."""
        plan = self._paired_plan(labels, adapters, prompts, alternatives)
        analyses = paired_effects.run(plan, engine, self.harness.reference(self.model_dir), self.tolerance)
        self._judge_effects(analyses, label or ", ".join(_adapter_names(labels)) or "base")
        self.assert_free_running_matches(engine, labels, {**adapters, **alternatives.old}, prompts, label=label)
        return analyses

    def assert_prompt_logprobs_conform(self, engine, labels: Sequence[Optional[str]],
                                       adapters: Mapping[str, AdapterRef] = {},
                                       prompts: Optional[Sequence[str]] = None, *, label: str = "") -> list:
        """``assert_conforms``' paired verdict on the engine's *prompt* logprobs
        (``paired_effects.run_prompt_logprobs``): every prompt position is a teacher-forced context; the
        engine's effect (prompt logprobs with the row's adapter minus without, both from the engine)
        must match the reference's and be nearest the correct hypothesis. Pooled over every position
        of every row: no single position decides. Returns the analyses."""
        plan = self._paired_plan(labels, adapters, prompts, Alternatives())
        analyses = paired_effects.run_prompt_logprobs(plan, engine, self.harness.reference(self.model_dir),
                                                      self.tolerance)
        self._judge_effects(analyses, label or "prompt logprobs " + (", ".join(_adapter_names(labels)) or "base"),
                            {"logprobs": "prompt"})
        return analyses

    def assert_free_running_matches(self, engine, labels: Sequence[Optional[str]],
                                    adapters: Mapping[str, AdapterRef] = {}, prompts: Optional[Sequence[str]] = None,
                                    *, label: str = "") -> None:
        """The greedy decode of one request per label (prompts taken in turn) against the reference, at
        the gross bounds (``free_running_atol``): tie-aware tokens and ROUGE-L, the decode path."""
        reqs = self.requests(list(labels), prompts=list(prompts or self.prompts))
        self.assert_matches_reference(engine.generate(reqs), self.reference(reqs, adapters), reqs, label=label,
                                      tolerance=self.free_running_tolerance)

    @property
    def free_running_tolerance(self):
        """The dtype's tolerance with its decode and tie bounds at ``free_running_atol``: the bound
        calibrated by null runs of correct engines (PEFT among them) on strong all-linear adapters,
        for free-running decodes that a strict per-step bound (fitted to the default adapters and
        prompts) does not cover. Equal to the strict one in float32."""
        from dataclasses import replace

        tol = self.tolerance
        return replace(tol, decode_atol=max(tol.decode_atol, tol.free_running_atol),
                       tie_margin=max(tol.tie_margin, tol.free_running_atol))

    def _paired_plan(self, labels: Sequence[Optional[str]], adapters: Mapping[str, AdapterRef],
                     prompts: Optional[Sequence[str]], alternatives: Alternatives) -> paired_effects.Plan:
        paths = {n: self.adapter_path(adapters.get(n, n)) for n in _adapter_names(labels)}
        old = {n: self.adapter_path(ref) for n, ref in alternatives.old.items()}
        return paired_effects.plan(labels, list(prompts or self.prompts), paths, old, alternatives.modules)

    def _judge_effects(self, analyses: list, label: str, extra_evidence: Optional[dict] = None) -> None:
        from lora_conformance import evidence
        from lora_conformance.compare.effects import assert_effects_conform

        evidence.add(self.request.node, evidence.EFFECTS, [a.as_evidence() for a in analyses])
        assert_effects_conform(analyses, label=label, extra_evidence=extra_evidence)

    def assert_matches_reference(self, outputs: Sequence[GenerationResult], references: Sequence[GenerationResult],
                                 requests: Sequence[GenerationRequest], label: str = "", tolerance=None) -> None:
        """Prompt logprobs (pooled over every request), decode logprobs (tie-aware) and ROUGE-L of every
        output against its reference."""
        from lora_conformance.compare import assert_logprobs_close, assert_prompt_logprobs_close, assert_rouge_l

        assert len(outputs) == len(references) == len(requests), "one output per request"
        tol = tolerance or self.tolerance
        whats = [f"{label + ' ' if label else ''}slot {i} (adapter={req.adapter or 'base'})"
                 for i, req in enumerate(requests)]
        assert_prompt_logprobs_close(outputs, references, tol, labels=whats, decode=self.decode)
        for out, ref, what in zip(outputs, references, whats):
            agreement = assert_logprobs_close(out, ref, tol, label=what, decode=self.decode, check_prompt=False)
            if agreement.tie_at is None:
                assert_rouge_l(out.text, ref.text, tol.rouge_l_min, label=what)

    def close(self) -> None:
        from lora_conformance.engines.base import EngineError

        for engine, name in reversed(self._loaded):
            if engine in self._own_engines:
                continue
            try:
                if name in engine.list_adapters():
                    engine.unload_adapter(name)
            except EngineError:
                pass  # the test itself may have unloaded or replaced it
        for engine in self._own_engines:
            self.harness.retire(engine)
