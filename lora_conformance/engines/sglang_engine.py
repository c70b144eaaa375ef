"""The ``sglang`` engine: SGLang's offline ``sglang.Engine`` with LoRA enabled.

NOT YET RUN ON REAL HARDWARE by this project: SGLang does not run on the CPU-only machines
it is developed on. The request and response mapping follows SGLang's source
(python/sglang/srt/entrypoints/engine.py: ``Engine.generate`` / ``load_lora_adapter`` /
``unload_lora_adapter`` / ``encode``; the tokenizer manager's logprob format) and is
tested against a stand-in module (tests/test_engine_sglang.py). Treat the first real run
as a test of this plugin too.

Mapping:
- one ``generate`` call per batch: ``prompt=[...]``, one sampling-params dict per request
  (``temperature=0``, ``max_new_tokens``, ``ignore_eos``), ``lora_path=[name or None]``,
  ``return_logprob=True``, ``top_logprobs_num=[k]``, ``logprob_start_len=[0 or -1]``
  (0 = prompt logprobs from the first token; -1 = output only);
- ``meta_info["output_top_logprobs"]``: per step a list of ``(logprob, token_id, text)``;
  ``meta_info["input_top_logprobs"]``: the same per prompt position, the first one None
  (nothing predicts the first token) -- it is dropped, so entry i predicts token i+1;
- token ids from ``output_ids`` (or the ids inside ``output_token_logprobs``).

Limits: SGLang's ``max_loras_per_batch`` counts the base model as one slot; the engine arg
of that name means adapters per batch (as for every engine here) and is passed on + 1.

Engine args: max_loras_per_batch, max_loaded_loras, max_lora_rank, lora_target_modules,
lora_backend, lora_eviction_policy, enable_lora_overlap_loading, attention_backend,
mem_fraction_static, context_length, disable_cuda_graph, random_seed, capabilities
(an explicit list overriding the declared set, for a verified deployment).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import (
    arg_bool,
    arg_float,
    arg_int,
    check_known_args,
    is_encoder_only,
    load_tokenizer,
    trim_topk,
)
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
    translate_standard_args,
)
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

EVICTION = {"lru": Capability.EVICTION_LRU, "fifo": Capability.EVICTION_FIFO}


class SGLangEngine(Engine):
    name = "sglang"
    KNOWN_ARGS = (
        "max_loras_per_batch", "max_loaded_loras", "max_lora_rank", "lora_target_modules", "lora_backend",
        "lora_eviction_policy", "enable_lora_overlap_loading", "attention_backend", "mem_fraction_static",
        "context_length", "disable_cuda_graph", "disable_radix_cache", "random_seed", "capabilities",
    )

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        # Standard (suite) args in SGLang's words. max_loras_per_batch means adapters per batch
        # here as everywhere in this project; SGLang counts the base model as a slot, hence + 1.
        self.args = translate_standard_args(self.name, self.args, {
            "max_loras_per_batch": lambda v: {"max_loras_per_batch": str(int(v) + 1)},
            "max_rank": lambda v: {"max_lora_rank": v},
            "eviction": lambda v: {"lora_eviction_policy": v},
            "overlap_loading": lambda v: {"enable_lora_overlap_loading": v},
            "graphs": lambda v: {"disable_cuda_graph": "0" if v == "1" else "1"},
            "prefix_cache": lambda v: {"disable_radix_cache": "0" if v == "1" else "1"},
        })
        check_known_args(self.name, self.args, self.KNOWN_ARGS)
        a, n = self.args, self.name
        per_batch = arg_int(n, a, "max_loras_per_batch", 8)
        loaded = arg_int(n, a, "max_loaded_loras", max(16, per_batch))
        rank = arg_int(n, a, "max_lora_rank", 64)
        policy = a.get("lora_eviction_policy", "lru")
        if policy not in EVICTION:
            raise EngineError(f"engine 'sglang': lora_eviction_policy={policy!r}; expected lru or fifo")
        overlap = arg_bool(n, a, "enable_lora_overlap_loading", False)
        no_graphs = arg_bool(n, a, "disable_cuda_graph", devices.device_type(device) == "cpu")
        self.is_encoder = is_encoder_only(self.model_dir)
        kwargs: dict[str, Any] = dict(
            model_path=str(self.model_dir),
            enable_lora=True,
            max_loras_per_batch=per_batch,
            max_loaded_loras=loaded,
            max_lora_rank=rank,
            lora_target_modules=a.get("lora_target_modules", "all").replace(",", " ").split(),
            lora_eviction_policy=policy,
            device=devices.device_type(device),
            dtype=dtype,
            disable_cuda_graph=no_graphs,
            random_seed=arg_int(n, a, "random_seed", 0),
        )
        if ":" in device:
            kwargs["base_gpu_id"] = int(device.split(":", 1)[1])
        if self.is_encoder:
            kwargs["is_embedding"] = True
        if overlap:
            kwargs["enable_lora_overlap_loading"] = True
        if arg_bool(n, a, "disable_radix_cache", False):
            kwargs["disable_radix_cache"] = True
        for key, parse in (("lora_backend", str), ("attention_backend", str)):
            if a.get(key):
                kwargs[key] = parse(a[key])
        for key in ("mem_fraction_static",):
            value = arg_float(n, a, key, None)
            if value is not None:
                kwargs[key] = value
        if arg_int(n, a, "context_length", None):
            kwargs["context_length"] = arg_int(n, a, "context_length", None)
        devices.set_start_method_for(device)  # SGLang on accelerators needs spawn
        try:
            import sglang
        except ImportError as exc:
            raise EngineFailure(f"engine 'sglang' needs SGLang installed ({exc}): pip install 'lora-conformance[sglang]'") from exc
        try:
            self.engine = sglang.Engine(**kwargs)
        except Exception as exc:  # start-up failures come in many types; all mean "cannot serve"
            raise EngineFailure(f"SGLang failed to start for {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        self._version = getattr(sglang, "__version__", "unknown")
        self._adapters: dict[str, str] = {}
        self._tokenizer = None

        caps = {Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.PINNING, Capability.MAX_LOADED,
                EVICTION[policy], Capability.PROMPT_LOGPROBS}
        if overlap:
            caps.add(Capability.OVERLAP_LOADING)
        if not no_graphs:
            caps.add(Capability.GRAPHS)
        if self.is_encoder:
            caps = {Capability.EMBEDDINGS, Capability.DYNAMIC_LOADING, EVICTION[policy]}
        if a.get("capabilities"):
            caps = {Capability.parse(c) for c in a["capabilities"].replace(",", " ").split()}
        self.capabilities = frozenset(caps)
        self.limits = Limits(max(1, per_batch - 1), loaded, rank)

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
        self._check_update(out, f"unloading adapter {name!r}")
        del self._adapters[name]

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def _check_update(self, out: Any, what: str) -> None:
        """SGLang answers LoRA updates with an object (success, error_message), not an exception."""
        ok = out.get("success", True) if isinstance(out, dict) else getattr(out, "success", True)
        if ok:
            return
        msg = (out.get("error_message") if isinstance(out, dict) else getattr(out, "error_message", "")) or ""
        full = f"SGLang {what}: {msg}"
        low = msg.lower()
        if "pinned" in low or "no available" in low or "capacity" in low:
            raise CapacityError(full)
        if "never been loaded" in low or "not loaded" in low:
            raise EngineError(full)
        if "not support" in low or "dora" in low:
            raise UnsupportedFeatureError(full)
        raise AdapterIncompatibleError(full)

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
                raise AdapterIncompatibleError(f"SGLang {method}: {exc}") from exc
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
