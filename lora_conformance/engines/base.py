"""The engine interface: what a LoRA inference engine must offer to be certified.

An engine is created from a base-model directory, a device string, a dtype name and
free-form engine args (``--engine-arg KEY=VALUE``). It declares capabilities from one
fixed vocabulary and its limits; the suites skip (as *not certified*) whatever an
engine does not declare. Everything else is the suite's job.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from lora_conformance.types import GenerationRequest, GenerationResult


class Capability(str, enum.Enum):
    """The fixed vocabulary of engine capabilities (``@pytest.mark.requires(...)`` takes these values)."""

    MIXED_BATCH = "mixed_batch"  # different adapters (and the base) in one batch
    DYNAMIC_LOADING = "dynamic_loading"  # load/unload adapters after start-up
    PINNING = "pinning"
    EVICTION_LRU = "eviction_lru"
    EVICTION_FIFO = "eviction_fifo"
    MAX_LOADED = "max_loaded"  # a bounded host cache of loaded adapters (more adapters than slots)
    PREFIX_CACHE = "prefix_cache"
    OVERLAP_LOADING = "overlap_loading"
    GRAPHS = "graphs"
    EMBEDDINGS = "embeddings"
    MOE = "moe"
    RSLORA = "rslora"
    RANK_PATTERN = "rank_pattern"
    EMBED_TOKENS = "embed_tokens"
    LM_HEAD = "lm_head"
    DORA = "dora"
    MODULES_TO_SAVE = "modules_to_save"
    PROMPT_LOGPROBS = "prompt_logprobs"
    LORA_BIAS = "lora_bias"
    TENSOR_PARALLEL = "tensor_parallel"  # shards the model (and its LoRA) over several devices
    CHUNKED_PREFILL = "chunked_prefill"  # honours the standard arg chunked_prefill_size
    INFLIGHT_LIFECYCLE = "inflight_lifecycle"  # submit(); load / unload / reload while requests run

    @classmethod
    def parse(cls, value: "str | Capability") -> "Capability":
        if isinstance(value, Capability):
            return value
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown engine capability {value!r}; known capabilities: {known}") from None


ALL_CAPABILITIES: frozenset[Capability] = frozenset(Capability)


@dataclass(frozen=True)
class Limits:
    max_loras_per_batch: int  # adapters (not counting the base) active in one forward
    max_loaded_loras: int  # adapters held by the engine at once (>= max_loras_per_batch)
    max_rank: int
    max_top_k: Optional[int] = None  # logprobs returned per generated token (None: as many as asked)


# ---- typed errors -------------------------------------------------------------------


class EngineError(Exception):
    """Base of every error an engine raises on purpose."""


class AdapterNotLoadedError(EngineError, KeyError):
    def __init__(self, name: str, loaded: Sequence[str] = ()):
        self.name = name
        self.loaded = list(loaded)
        super().__init__(f"adapter {name!r} is not loaded (loaded: {', '.join(self.loaded) or 'none'})")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class AdapterIncompatibleError(EngineError, ValueError):
    """The adapter cannot be served by this engine (rank too large, unknown target module, ...)."""


class AdapterFormatError(AdapterIncompatibleError):
    """The adapter directory is malformed, or does not fit the base model or the engine's limits.

    ``file`` is the offending file (or the directory), ``field`` the config field or tensor name.
    """

    def __init__(self, file, field: str, problem: str):
        self.file, self.field, self.problem = str(file), field, problem
        super().__init__(f"{self.file}: {field}: {problem}")


class CapacityError(EngineError, RuntimeError):
    """No slot can be found: every slot pinned, or pinning would starve unpinned requests."""


class UnsupportedFeatureError(EngineError, NotImplementedError):
    """The adapter or request uses a feature the engine refuses (DoRA, modules_to_save, ...)."""


class EngineFailure(EngineError, RuntimeError):
    """The engine broke (crashed worker, server error, timeout)."""


class AdapterInUseError(EngineError, RuntimeError):
    """Unloading or replacing an adapter that running requests use is refused (an engine may wait instead)."""

    def __init__(self, name: str, requests: int):
        self.name, self.requests = name, requests
        super().__init__(f"adapter {name!r} is used by {requests} running request(s); retry when they finish")


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


# ---- standard engine args -------------------------------------------------------------

# Suites ask for engine configurations in these words; each plugin maps them onto its own.
STANDARD_ARGS = ("max_loras_per_batch", "max_loaded_loras", "max_rank", "eviction", "prefix_cache",
                 "overlap_loading", "graphs", "tensor_parallel", "lora_backend", "chunked_prefill_size")
# tensor_parallel: devices the model is sharded over (1: none); lora_backend: the engine's own LoRA
# kernel backend name; chunked_prefill_size: tokens per prefill chunk.


def translate_standard_args(engine: str, args: Mapping[str, str],
                            mapping: Mapping[str, Callable[[str], dict[str, str]]]) -> dict[str, str]:
    """Replace standard keys by the engine's own (an engine-specific key given explicitly wins).

    A mapping function raises UnsupportedFeatureError for a value the engine cannot honour.
    """
    out = {k: v for k, v in args.items() if k not in mapping}
    for key, translate in mapping.items():
        if key in args:
            for own_key, own_value in translate(str(args[key])).items():
                out.setdefault(own_key, own_value)
    return out


def only(engine: str, key: str, supported: str) -> Callable[[str], dict[str, str]]:
    """A standard arg the engine has no knob for: accept only the value it always behaves as."""

    def check(value: str) -> dict[str, str]:
        if value != supported:
            raise UnsupportedFeatureError(f"engine {engine!r} cannot run with {key}={value} (only {key}={supported})")
        return {}

    return check


# ---- the interface ------------------------------------------------------------------


class Engine(ABC):
    """Subclass this, set ``name``, fill ``capabilities`` and ``limits`` in ``__init__``."""

    name: str = "abstract"
    capabilities: frozenset[Capability] = frozenset()
    limits: Limits = Limits(max_loras_per_batch=1, max_loaded_loras=1, max_rank=0)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype = dtype
        self.args = dict(args)

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
    def declared_capabilities(cls, device: str, args: Mapping[str, str]) -> Optional[frozenset[Capability]]:
        """The capabilities an engine started on ``device`` with ``args`` would declare, known
        without starting it; None when only a live engine knows. The suites skip a test whose
        requirements are missing here before any engine starts."""
        return None

    @classmethod
    def backends(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """The compute backends this engine can run on ``device_type``: engine-arg key -> the values
        it accepts (e.g. ``{"lora_backend": ("triton", "csgmv")}``). The backend suite runs each."""
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
