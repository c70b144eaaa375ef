"""The ``sglang`` engine: SGLang's offline ``sglang.Engine`` with LoRA enabled.

NOT YET RUN ON REAL HARDWARE by this project: PyPI's SGLang (0.5.23) pins torch 2.14.1 and
ships CUDA kernels, so it runs neither on the CPU machines this project is developed on nor
beside the torch 2.11 of the H200 lent to it. What it declares and how it maps requests were
read from SGLang's source (``sglang_releases.py`` lists the files and releases) and are
tested against a stand-in that enforces SGLang's limits and answers with its error texts
(tests/_sglang_standin.py, tests/test_engine_sglang.py). Treat the first real run as a test
of this plugin too.

Capabilities come from the installed release's row in ``sglang_releases.RELEASES``
(``sglang.__version__``) and the configuration: the radix cache (prefix_cache) unless turned
off, pinning, host-cache eviction past max_loaded_loras (max_loaded, 0.5.8+), the configured
pool eviction policy, overlap loading, embed_tokens / lm_head (0.5.8+, when targeted), MoE
(0.5.13+), graphs unless disabled, tensor parallel. Never rslora or rank_pattern: no release
reads ``use_rslora`` or the patterns.

Standard args in SGLang's words: max_loras_per_batch -> max_loras_per_batch + 1 (SGLang
counts the base model as a slot), max_loaded_loras, max_rank -> max_lora_rank, eviction ->
lora_eviction_policy, overlap_loading -> enable_lora_overlap_loading, prefix_cache ->
disable_radix_cache (inverted), graphs -> disable_cuda_graph (inverted), lora_backend,
chunked_prefill_size, tensor_parallel -> tp_size. A configuration SGLang would refuse at
start-up is refused here first (UnsupportedFeatureError, with SGLang's message).

What the plugin does in SGLang's place (nothing else is refused or repaired; SGLang gets every
adapter as it is): a start-up configuration SGLang refuses is refused first with SGLang's own
message (its checks run in ``ServerArgs.__post_init__`` inside a subprocess, whose traceback would
otherwise be the only trace); a name loaded again is unloaded first (SGLang answers "already
loaded"); the first prompt-logprob entry (None) is dropped and top-k lists become dicts (format).

Requests: one ``generate`` call per batch: ``prompt=[...]``, one sampling-params dict per
request (``temperature=0``, ``max_new_tokens``, ``ignore_eos``), ``lora_path=[name or None]``,
``return_logprob=True``, ``top_logprobs_num=[k]``, ``logprob_start_len=[0 or -1]``;
``meta_info["output_top_logprobs"]`` per step a list of ``(logprob, token_id, text)``;
``meta_info["input_top_logprobs"]`` the same per prompt position, the first one None (dropped,
so entry i predicts token i+1); token ids from ``output_ids``.

Engine args: the standard ones, and max_lora_rank, lora_target_modules, lora_backend,
lora_eviction_policy, enable_lora_overlap_loading, attention_backend, mem_fraction_static,
context_length, disable_cuda_graph, disable_radix_cache, chunked_prefill_size, tp_size,
random_seed, capabilities (an explicit list overriding the declared set, for a verified
deployment).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import is_encoder_only, load_tokenizer, trim_topk
from lora_conformance.engines.args import Rename, Via, arg, capability_list
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    CapacityError,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    UnsupportedFeatureError,
)
from lora_conformance.engines.sglang_releases import ConfigRefused, Release, ServerConfig, release_for, validate
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

EVICTION = {"lru": Capability.EVICTION_LRU, "fifo": Capability.EVICTION_FIFO}

# SGLang's error texts (srt/lora/lora_manager.py, lora_registry.py, managers/tokenizer_*) -> our types.
CAPACITY_TEXTS = ("not allowed to pin all slots", "maximum number of loaded lora adapters",
                  "didn't find any lora adapters when trying to evict", "unique loras requested")
NOT_LOADED_TEXTS = ("never been loaded", "does not exist", "are not loaded")
UNSUPPORTED_TEXTS = ("doesn't support dora", "add tokens to the vocabulary", "not support")


def map_sglang_error(message: str, what: str) -> EngineError:
    """One of our typed errors for an SGLang error message (SGLang answers with text only)."""
    full = f"SGLang {what}: {message}"
    low = message.lower()
    if "unique loras requested" in low:
        full += " (SGLang counts the base model, lora_path None, as one of them)"
    if any(t in low for t in CAPACITY_TEXTS):
        return CapacityError(full)
    if any(t in low for t in NOT_LOADED_TEXTS):
        return EngineError(full)
    if any(t in low for t in UNSUPPORTED_TEXTS):
        return UnsupportedFeatureError(full)
    return AdapterIncompatibleError(full)


@dataclass(frozen=True)
class SGLangArgs:
    """SGLang's own server arguments, passed on as named. Their values are checked by SGLang's
    own rules (``sglang_releases.validate``, with SGLang's messages) before it starts."""

    max_loras_per_batch: int = arg(8, "SGLang max_loras_per_batch, the base model counted as one (the standard "
                                      "arg, which does not count it, sets this to its value + 1)", minimum=1)
    max_loaded_loras: Optional[int] = arg(None, "SGLang max_loaded_loras (default: 2 x max_loras_per_batch with "
                                                "overlap loading, else max(16, max_loras_per_batch))")
    max_lora_rank: int = arg(64, "SGLang max_lora_rank")
    lora_target_modules: str = arg("all", "SGLang lora_target_modules, comma or space separated")
    lora_backend: Optional[str] = arg(None, "SGLang lora_backend (default: SGLang's)")
    lora_eviction_policy: Optional[str] = arg(None, "SGLang lora_eviction_policy (default: SGLang's, lru)")
    enable_lora_overlap_loading: bool = arg(False, "SGLang enable_lora_overlap_loading")
    attention_backend: Optional[str] = arg(None, "SGLang attention_backend (default: SGLang's)")
    mem_fraction_static: Optional[float] = arg(None, "SGLang mem_fraction_static (default: SGLang's)")
    context_length: Optional[int] = arg(None, "SGLang context_length (default: the model's)")
    disable_cuda_graph: Optional[bool] = arg(None, "SGLang disable_cuda_graph (default: on for cpu)")
    disable_radix_cache: Optional[bool] = arg(None, "SGLang disable_radix_cache (default: off where the release "
                                                    "serves LoRA with the radix cache)")
    chunked_prefill_size: Optional[int] = arg(None, "SGLang chunked_prefill_size (default: SGLang's)")
    tp_size: int = arg(1, "SGLang tp_size", minimum=1)
    random_seed: int = arg(0, "SGLang random_seed")
    capabilities: Optional[str] = arg(None, "the capabilities to declare, comma separated, overriding the release "
                                            "table (for a verified deployment)", check=capability_list)


def _batch_with_base(value: str) -> dict[str, str]:
    # max_loras_per_batch means adapters per batch here as everywhere in this project; SGLang
    # counts the base model as a slot, hence + 1.
    return {"max_loras_per_batch": str(int(value) + 1)}


def installed_release() -> Optional[Release]:
    """The release row of the SGLang that ``import sglang`` would give (None: none, or unmapped)."""
    import sys
    from importlib import metadata

    mod = sys.modules.get("sglang")
    try:
        version = str(getattr(mod, "__version__", "unknown")) if mod is not None else metadata.version("sglang")
        return release_for(version)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def _disable_cuda_graph(a: SGLangArgs, device: str) -> bool:
    return devices.device_type(device) == "cpu" if a.disable_cuda_graph is None else a.disable_cuda_graph


class SGLangEngine(Engine):
    name = "sglang"
    Args = SGLangArgs
    requires = ("sglang",)
    extra = "sglang"
    slow_start = True  # a server process and its warm-up
    standard_args = {
        "max_loras_per_batch": Via(_batch_with_base, "as max_loras_per_batch + 1"),
        "max_rank": Rename("max_lora_rank"),
        "eviction": Rename("lora_eviction_policy"),
        "overlap_loading": Rename("enable_lora_overlap_loading"),
        "graphs": Rename("disable_cuda_graph", invert=True),
        "prefix_cache": Rename("disable_radix_cache", invert=True),
        "tensor_parallel": Rename("tp_size"),
    }

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = self.parse_args(self.args)
        try:
            import sglang
        except ImportError as exc:
            raise EngineFailure(f"engine 'sglang' needs SGLang installed ({exc}): pip install 'lora-conformance[sglang]'") from exc
        self._version = str(getattr(sglang, "__version__", "unknown"))
        try:
            self.release = release_for(self._version)
        except ValueError as exc:
            raise EngineFailure(f"engine 'sglang': {exc}") from None
        self.is_encoder = is_encoder_only(self.model_dir)
        self.config = self._server_config(self.cfg, self.release)
        try:
            validate(self.release, self.config)
        except ConfigRefused as exc:
            raise UnsupportedFeatureError(f"engine 'sglang' ({self._version}): {exc}") from None
        kwargs = self._server_args(self.config)
        devices.set_start_method_for(device)  # SGLang on accelerators needs spawn
        try:
            self.engine = sglang.Engine(**kwargs)
        except Exception as exc:  # start-up failures come in many types; all mean "cannot serve"
            raise EngineFailure(f"SGLang failed to start for {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        self._adapters: dict[str, str] = {}
        self._tokenizer = None
        self.capabilities = self._capabilities(self.cfg, self.release, self.config, self.is_encoder, device)
        c = self.config
        self.limits = Limits(max(1, c.max_loras_per_batch - 1), c.max_loaded_loras, c.max_lora_rank)

    @classmethod
    def declared_capabilities(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str):
        """None where SGLang is not installed, its release is not mapped, or it would refuse this
        configuration: the engine's start says why."""
        release = installed_release()
        if release is None:
            return None
        config = cls._server_config(cfg, release)
        try:
            validate(release, config)
        except ConfigRefused:
            return None
        encoder = model_dir is not None and is_encoder_only(Path(model_dir))
        return cls._capabilities(cfg, release, config, encoder, device)

    @classmethod
    def declared_limits(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str) -> Optional[Limits]:
        release = installed_release()
        if release is None:
            return None
        c = cls._server_config(cfg, release)
        return Limits(max(1, c.max_loras_per_batch - 1), c.max_loaded_loras, c.max_lora_rank)

    @staticmethod
    def _server_config(a: SGLangArgs, release: Release) -> ServerConfig:
        per_batch = a.max_loras_per_batch
        overlap = a.enable_lora_overlap_loading
        # With overlap loading SGLang allows at most 2 x max_loras_per_batch loaded adapters.
        loaded = a.max_loaded_loras if a.max_loaded_loras is not None else (
            2 * per_batch if overlap else max(16, per_batch))
        return ServerConfig(
            max_loras_per_batch=per_batch,
            max_loaded_loras=loaded,
            max_lora_rank=a.max_lora_rank,
            lora_target_modules=tuple(a.lora_target_modules.replace(",", " ").split()),
            lora_backend=a.lora_backend or None,
            lora_eviction_policy=a.lora_eviction_policy or None,
            enable_lora_overlap_loading=overlap,
            disable_radix_cache=not release.radix_cache if a.disable_radix_cache is None else a.disable_radix_cache,
            chunked_prefill_size=a.chunked_prefill_size,
            tp_size=a.tp_size,
        )

    def _server_args(self, c: ServerConfig) -> dict[str, Any]:
        a = self.cfg
        kwargs: dict[str, Any] = dict(
            model_path=str(self.model_dir),
            enable_lora=True,
            max_loras_per_batch=c.max_loras_per_batch,
            max_loaded_loras=c.max_loaded_loras,
            max_lora_rank=c.max_lora_rank,
            lora_target_modules=list(c.lora_target_modules),
            device=devices.device_type(self.device),
            dtype=self.dtype,
            disable_cuda_graph=_disable_cuda_graph(a, self.device),
            random_seed=a.random_seed,
        )
        optional = {
            "lora_backend": c.lora_backend,
            "lora_eviction_policy": c.lora_eviction_policy,
            "enable_lora_overlap_loading": c.enable_lora_overlap_loading or None,
            "disable_radix_cache": c.disable_radix_cache or None,
            "chunked_prefill_size": c.chunked_prefill_size,
            "tp_size": c.tp_size if c.tp_size != 1 else None,
            "attention_backend": a.attention_backend or None,
            "mem_fraction_static": a.mem_fraction_static,
            "context_length": a.context_length,
            "is_embedding": True if self.is_encoder else None,
            "base_gpu_id": int(self.device.split(":", 1)[1]) if ":" in self.device else None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs

    @staticmethod
    def _capabilities(a: SGLangArgs, release: Release, c: ServerConfig, is_encoder: bool, device: str) -> frozenset:
        return frozenset(SGLangEngine._capability_set(a, release, c, is_encoder, device))

    @staticmethod
    def _capability_set(a: SGLangArgs, release: Release, c: ServerConfig, is_encoder: bool,
                        device: str) -> set[Capability]:
        policy = c.lora_eviction_policy or "lru"
        evicts = {EVICTION[policy]} if release.eviction_policies else set()
        if a.capabilities:
            return {Capability.parse(x) for x in a.capabilities.replace(",", " ").split()}
        if is_encoder:
            return {Capability.EMBEDDINGS, Capability.DYNAMIC_LOADING} | evicts
        caps = {Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.PROMPT_LOGPROBS,
                Capability.TENSOR_PARALLEL} | evicts
        targets = set(c.lora_target_modules)
        flags = {
            Capability.PINNING: release.pinning,
            Capability.MAX_LOADED: release.beyond_max_loaded == "evict",
            Capability.OVERLAP_LOADING: c.enable_lora_overlap_loading,
            Capability.PREFIX_CACHE: release.radix_cache and not c.disable_radix_cache,
            Capability.GRAPHS: not _disable_cuda_graph(a, device),
            Capability.EMBED_TOKENS: release.embed_tokens and bool(targets & {"all", "embed_tokens"}),
            Capability.LM_HEAD: release.lm_head and bool(targets & {"all", "lm_head"}),
            Capability.MOE: release.moe,
        }
        return caps | {cap for cap, on in flags.items() if on}

    # ---- adapters -------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        if name in self._adapters:
            self.unload_adapter(name)  # SGLang refuses a loaded name ("already loaded")
        out = self._call("load_lora_adapter", name, str(path), pinned)
        self._check_update(out, f"loading adapter {name!r} from {path}")
        self._adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoadedError(name, self.list_adapters())
        out = self._call("unload_lora_adapter", name)
        try:
            self._check_update(out, f"unloading adapter {name!r}")
        except EngineError as exc:
            # SGLang (0.5.8+) unregisters the least recently used adapter past max_loaded_loras and
            # loads it again when a request names it; an explicit unload of it then answers
            # "LoRA with name X does not exist". Ours to forget: no request of ours names it again.
            if "does not exist" not in str(exc):
                raise
        del self._adapters[name]

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def _check_update(self, out: Any, what: str) -> None:
        """SGLang answers LoRA updates with an object (success, error_message), not an exception."""
        ok = out.get("success", True) if isinstance(out, dict) else getattr(out, "success", True)
        if ok:
            return
        msg = (out.get("error_message") if isinstance(out, dict) else getattr(out, "error_message", "")) or ""
        raise map_sglang_error(msg, what)

    # ---- generation -----------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.require_loaded(requests)
        if not requests:
            return []
        outs = self._call(
            "generate",
            prompt=[r.prompt for r in requests],
            sampling_params=[{"temperature": 0.0, "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos}
                             for r in requests],
            lora_path=[r.adapter for r in requests],
            return_logprob=True,
            top_logprobs_num=[r.top_k for r in requests],
            logprob_start_len=[0 if r.prompt_logprobs else -1 for r in requests],
        )
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(requests):
            raise EngineFailure(f"SGLang returned {len(outs)} outputs for {len(requests)} requests")
        return [self._result(r, o) for r, o in zip(requests, outs)]

    @staticmethod
    def _top(entries: Optional[Sequence], k: int) -> TopK:
        return trim_topk({int(t[1]): float(t[0]) for t in entries or () if t[0] is not None}, k)

    def _result(self, req: GenerationRequest, out: Mapping[str, Any]) -> GenerationResult:
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids")
        if ids is None:
            ids = [int(t[1]) for t in meta.get("output_token_logprobs") or ()]
        ids = [int(t) for t in ids]
        steps = [self._top(e, req.top_k) for e in meta.get("output_top_logprobs") or ()]
        prompt_ids = [int(t[1]) for t in meta.get("input_token_logprobs") or ()] if req.prompt_logprobs else []
        if not prompt_ids:
            prompt_ids = list(self._tok()(req.prompt)["input_ids"])
        prompt_lps = None
        if req.prompt_logprobs:
            raw = list(meta.get("input_top_logprobs") or ())
            prompt_lps = [self._top(e, req.top_k) for e in raw[1:]]  # raw[0] is None
        cached = meta.get("cached_tokens")
        return GenerationResult(token_ids=ids, text=out.get("text", ""), logprobs=steps,
                                prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps,
                                cached_tokens=None if cached is None else int(cached))

    def embed(self, texts: Sequence[str], adapter: Optional[str] = None) -> list[list[float]]:
        if not self.is_encoder:
            raise UnsupportedFeatureError(f"engine 'sglang': {self.model_dir} is not an embedding model")
        if adapter is not None and adapter not in self._adapters:
            raise AdapterNotLoadedError(adapter, self.list_adapters())
        outs = self._call("encode", prompt=list(texts), lora_path=[adapter] * len(texts))
        if isinstance(outs, dict):
            outs = [outs]
        vectors = []
        for o in outs:
            v = [float(x) for x in o["embedding"]]
            norm = sum(x * x for x in v) ** 0.5 or 1.0
            vectors.append([x / norm for x in v])  # pooling is SGLang's (model config); the norm is ours
        return vectors

    # ---- plumbing ---------------------------------------------------------------------

    def _call(self, method: str, *args, **kwargs):
        engine = getattr(self, "engine", None)
        if engine is None:
            raise EngineFailure("SGLang engine is closed")
        try:
            return getattr(engine, method)(*args, **kwargs)
        except EngineError:
            raise
        except (ValueError, TypeError) as exc:
            text = str(exc).lower()
            if "lora" in text or "adapter" in text:
                raise map_sglang_error(str(exc), method) from exc
            raise EngineError(f"SGLang {method}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise EngineFailure(f"SGLang {method}: {type(exc).__name__}: {exc}") from exc

    def _tok(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass  # already gone

    def version(self) -> str:
        return f"sglang {self._version}"
