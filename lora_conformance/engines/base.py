"""The engine interface: what a LoRA inference engine must offer to be certified.

An engine is created from a base-model directory, a device string, a dtype name and
free-form engine args (``--engine-arg KEY=VALUE``). It declares capabilities from one
fixed vocabulary and its limits; the suites skip (as *not certified*) whatever an
engine does not declare. Everything else is the suite's job.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Hashable, Mapping, Optional, Sequence

from lora_conformance.types import GenerationRequest, GenerationResult
# The vocabulary and the errors live below the engines; every engine plugin imports them from here.
from lora_conformance.capabilities import ALL_CAPABILITIES, Capability, Limits  # noqa: F401
from lora_conformance.errors import (  # noqa: F401
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterInUseError,
    AdapterNotLoadedError,
    CapacityError,
    EngineError,
    EngineFailure,
    UnsupportedFeatureError,
)


class RequestHandle(ABC):
    """Requests submitted with ``Engine.submit``: running while the caller does other things."""

    @abstractmethod
    def done(self) -> bool:
        """Every request of the handle has finished."""

    @abstractmethod
    def wait_started(self, timeout: float) -> bool:
        """Block until every request has produced its first token (or finished); False on timeout."""

    @abstractmethod
    def result(self, timeout: float) -> list[GenerationResult]:
        """The results in request order; raises EngineFailure on timeout."""


class FuturesHandle(RequestHandle):
    """A ``RequestHandle`` over one future per request (each run on a thread of the plugin's) and
    one event per request, set when it has produced its first token."""

    def __init__(self, futures: Sequence[Any], started: Sequence[threading.Event]):
        self._futures, self._started = list(futures), list(started)

    @classmethod
    def on_threads(cls, run_one, requests: Sequence[Any]) -> "FuturesHandle":
        """Each request on a thread of its own: ``run_one(request, started)`` returns its result and
        sets ``started`` at its first token (a served engine streaming one request per connection)."""
        from concurrent.futures import ThreadPoolExecutor

        started = [threading.Event() for _ in requests]
        pool = ThreadPoolExecutor(max_workers=max(1, len(requests)))
        futures = [pool.submit(run_one, r, ev) for r, ev in zip(requests, started)]
        pool.shutdown(wait=False)
        return cls(futures, started)

    @property
    def futures(self) -> list[Any]:
        return list(self._futures)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait_started(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(ev.wait(max(0.0, deadline - time.monotonic())) for ev in self._started)

    def result(self, timeout: float) -> list[GenerationResult]:
        deadline = time.monotonic() + timeout
        out = []
        for f in self._futures:
            try:
                out.append(f.result(max(0.0, deadline - time.monotonic())))
            except TimeoutError as exc:
                raise EngineFailure(f"streamed requests did not finish within {timeout:g} s") from exc
        return out


class AdaptersInUse:
    """How many submitted requests use each adapter name. For plugins whose engine drops an adapter
    at once (vLLM's ``remove_lora``, a server's unload route) while the interface promises that an
    unload waits for the requests that use it: the plugin counts its own requests and waits."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._cond = threading.Condition()

    def started(self, names: Sequence[str]) -> None:
        with self._cond:
            for name in names:
                self._count[name] = self._count.get(name, 0) + 1

    def finished(self, names: Sequence[str]) -> None:
        with self._cond:
            for name in names:
                self._count[name] -= 1
                if not self._count[name]:
                    del self._count[name]
            self._cond.notify_all()

    def finished_with(self, futures: Sequence[Any], names: Sequence[str]) -> None:
        """``finished(names)`` once, when the last of ``futures`` is done."""
        left, lock = [len(futures)], threading.Lock()

        def one_done(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.finished(names)

        if not futures:
            self.finished(names)
        for f in futures:
            f.add_done_callback(one_done)

    def wait_unused(self, name: str, timeout: Optional[float]) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._count.get(name), timeout=timeout)


# ---- standard engine args -------------------------------------------------------------

# Suites ask for engine configurations in a few standard words (engines/args.py STANDARD_ARGS,
# each with its type and meaning); each plugin maps them onto its own (``Engine.standard_args``).


def replace_or_restore(name: str, new: Path, old: Optional[Path], unload: Callable[[], None],
                       load: Callable[[Path], None], restorable: Callable[[], bool] = lambda: True,
                       restore_errors: tuple = (EngineError,)) -> None:
    """A transactional reload: ``load(new)`` as ``name``, unloading the loaded one first (``old``:
    its directory, None when ``name`` is new); when the engine refuses the new one (EngineError),
    ``load(old)`` puts the previous adapter back (where ``restorable()``: an engine that died of the
    refusal is not asked), and an engine that cannot do even that is broken (EngineFailure)."""
    if old is not None:
        unload()
    try:
        load(new)
    except EngineError:
        if old is not None and restorable():
            try:
                load(old)
            except restore_errors as exc:
                raise EngineFailure(f"reloading {name!r} from {new} was refused and the previous adapter from "
                                    f"{old} could not be restored: {exc}") from exc
        raise


def only(engine: str, key: str, supported: str) -> Callable[[str], dict[str, str]]:
    """A standard arg the engine has no knob for: accept only the value it always behaves as."""
    from lora_conformance.engines.args import Only

    return Only(engine, key, supported)


# ---- the interface ------------------------------------------------------------------


class Engine(ABC):
    """Subclass this, set ``name``, fill ``capabilities`` and ``limits`` in ``__init__``.

    Configuration as data (engines/args.py): ``Args`` is the engine's argument dataclass, every
    argument declared once with its type, default and meaning; ``standard_args`` maps each
    standard argument the engine honours onto its own; ``requires`` names the modules it
    imports (``extra``: the package extra that installs them). Then ``parse_args`` checks a
    run's engine args before any test, and ``declared_capabilities`` / ``declared_limits`` say
    what the engine offers without starting it. An engine without ``Args`` takes any args and
    checks them itself when it starts.
    """

    name: str = "abstract"
    capabilities: frozenset[Capability] = frozenset()
    limits: Limits = Limits(max_loras_per_batch=1, max_loaded_loras=1, max_rank=0)
    Args: ClassVar[Optional[type]] = None
    standard_args: ClassVar[Mapping[str, Callable[[str], dict[str, str]]]] = {}
    requires: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[Optional[str]] = None
    # Starting one takes long (processes, a server, tens of seconds): certify then keeps each suite
    # file on one pytest-xdist worker (--dist loadfile), so an engine with a file's settings starts
    # once, not once per worker.
    slow_start: ClassVar[bool] = False
    # Quantised bases (--base-quant, models/quant.py) this engine holds as quantised, scheme -> how.
    # Any other scheme is refused at start (UnsupportedFeatureError: the run's tests are *not
    # certified*, with this engine's list as the reason): an engine that would load the snapped
    # checkpoint's dequantised float weights would certify a float base under a quantised name.
    base_quantizations: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def parse_args(cls, raw: Mapping[str, str], source: "str | Mapping[str, str]" = "the engine's arguments") -> Any:
        """``--engine-arg`` strings -> an ``Args`` instance; EngineArgError (one line) when a name or
        value is bad, UnsupportedFeatureError when a standard value cannot be honoured. Without
        ``Args``: the strings, unchecked."""
        if cls.Args is None:
            return dict(raw)
        from lora_conformance.engines.args import parse_engine_args

        return parse_engine_args(cls.Args, raw, source, engine=cls.name, standard=cls.standard_args)

    @classmethod
    def declared_capabilities(cls, cfg: Any, model_dir: Optional[Path], device: str) -> Optional[frozenset[Capability]]:
        """The capabilities an engine of this class started with ``cfg`` (``parse_args``' result)
        on this base model (None: a decoder) and device would declare, or None when only a
        started engine can tell. The suites skip an undeclared feature on this answer, without
        starting an engine; a started engine's ``capabilities`` must equal it."""
        return None

    @classmethod
    def declared_activations(cls, cfg: Any, model_dir: Optional[Path], device: str,
                             dtype: Optional[str] = None) -> Optional[str]:
        """Where this engine's quantised-base matmuls read activations quantised to fewer bits than
        the run's dtype (llama.cpp's CPU kernels: 8-bit blocks in front of GGUF weights), the
        activation scheme (models/quant.py ``ACTIVATION_SCHEMES``); None: the activations stay in the
        run's dtype (``dtype``: the run's, None where unknown). It selects the tolerance rows for 8-bit
        activations (judge/tolerances.py ``ACTIVATIONS``), and the report says so."""
        return None

    @classmethod
    def not_declared_reasons(cls, cfg: Any, model_dir: Optional[Path], device: str) -> Mapping[Capability, str]:
        """Why an engine started with ``cfg`` does not declare a capability, with the evidence (the
        engine's source, its documentation, or our test of it), for those the plugin knows; the
        *not certified* rows of a report show it beside the capability."""
        return {}

    @classmethod
    def sharing_key(cls, cfg: Any, model_dir: Optional[Path], device: str) -> Hashable:
        """Equal keys mean engines of this class started with these parsed args behave alike, so the
        suites share one (harness.Harness.engine_key). The default: the args themselves, every
        field with its default filled in. A plugin whose "unset" stands for an engine default it
        knows resolves it here (vLLM: prefix caching on for decoders)."""
        return repr(cfg) if cls.Args is not None else tuple(sorted(dict(cfg).items()))

    @classmethod
    def declared_limits(cls, cfg: Any, model_dir: Optional[Path], device: str) -> Optional[Limits]:
        """The ``limits`` such an engine would have, or None when only a started engine can tell."""
        return None

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.args = dict(args)
        self.base_quant = self.check_base_quant(self.model_dir)

    @classmethod
    def check_base_quant(cls, model_dir: Path) -> str:
        """The base quantisation of ``model_dir`` ('none': float), or UnsupportedFeatureError where
        this engine does not hold that scheme (``base_quantizations``)."""
        from lora_conformance.models.quant import scheme_of

        scheme = scheme_of(model_dir)
        if scheme != "none" and scheme not in cls.base_quantizations:
            held = "; ".join(f"{k}: {v}" for k, v in cls.base_quantizations.items()) or "none (float bases only)"
            raise UnsupportedFeatureError(f"engine {cls.name!r} cannot hold a {scheme} quantised base "
                                          f"(--base-quant {scheme}); the schemes it holds: {held}")
        return scheme

    # adapters
    @abstractmethod
    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        """Load (or replace, when ``name`` is loaded already) a PEFT adapter directory."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Forget ``name``; raises AdapterNotLoadedError when it is not loaded."""

    @abstractmethod
    def list_adapters(self) -> list[str]: ...

    def engine_adapters(self) -> Optional[list[str]]:
        """The adapter names the engine itself reports loaded, asked now (its registry, a server's
        model list), not the plugin's own records; None when the engine has no such query. The
        lifecycle suites check ``list_adapters`` against it, and where it is None they say in the
        report that their list checks test the plugin's bookkeeping only."""
        return None

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache now (no request running); True when the engine did.
        The default (False: the engine has no such call) makes a test that needs a cold cache
        start a fresh engine instead (``TestContext.cold_engine``)."""
        return False

    def resident_adapters(self) -> Optional[list[str]]:
        """Names whose weights the engine holds now, within ``max_loaded_loras`` (what an eviction
        policy decides), or None when the engine cannot say: the eviction suites then do not
        certify the policy itself."""
        return None

    # inference
    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve all requests (as one batch where the engine can); results in request order."""

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestHandle:
        """Start serving ``requests`` and return at once (capability ``inflight_lifecycle``). While
        they run, other threads may submit, load, unload and reload adapters: every request is
        served entirely by the adapter weights registered when it was submitted; unloading or
        replacing a name that running requests use either waits for them or raises AdapterInUseError."""
        raise UnsupportedFeatureError(f"engine {self.name!r} does not serve requests concurrently (submit)")

    @classmethod
    def backends(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """The compute backends this engine can run on ``device_type``: engine-arg key -> the values
        it accepts (e.g. ``{"lora_backend": ("triton", "csgmv")}``). The backend suite runs each."""
        return {}

    @classmethod
    def exec_modes(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """The execution modes this engine declares on ``device_type`` (eager, compiled, captured
        graphs): engine-arg key -> the values that select each, e.g. ``{"exec_mode": ("eager",
        "compile", "graphs")}``. A feature is certified in a mode only by a run in it: the runtime
        modes suite serves mixed batches in each, and bench/certify_modes.py certifies the suites
        once per mode (a feature passes only where it passes in every mode)."""
        return {}

    def embed(self, texts: Sequence[str], adapter: Optional[str] = None) -> list[list[float]]:
        """L2-normalised embeddings of ``texts`` under ``adapter`` (None: the base model). An
        encoder engine that declares ``mixed_batch`` also takes a list, one adapter (or None) per text."""
        raise UnsupportedFeatureError(f"engine {self.name!r} does not produce embeddings")

    def close(self) -> None:
        """Release devices, workers and servers. Must be safe to call twice."""

    def version(self) -> str:
        """The engine's own version string, for the report."""
        return "unknown"

    def require_loaded(self, requests: Sequence[GenerationRequest]) -> None:
        """Raise AdapterNotLoadedError for the first request naming an adapter that is not loaded."""
        loaded = set(self.list_adapters())
        for r in requests:
            if r.adapter is not None and r.adapter not in loaded:
                raise AdapterNotLoadedError(r.adapter, sorted(loaded))

    def supports(self, cap: "Capability | str") -> bool:
        return Capability.parse(cap) in self.capabilities

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
