"""The ``llamacpp`` engine: llama.cpp (through llama-cpp-python's low-level API) serving GGUF LoRA.

The base checkpoint and every PEFT adapter go through our own converters
(``llamacpp_convert``: what each conversion does to LoRA semantics is stated there). Text is
tokenized by our tokenizer; token ids go to llama.cpp, and token ids and logits come back.
What llama.cpp offers, and so what this plugin declares (llama-cpp-python 0.3.36):

* Adapters: ``llama_adapter_lora_init(model, path)`` loads a GGUF LoRA;
  ``llama_set_adapters_lora(ctx, adapters, n, scales)`` sets the adapters of a *context*: every
  sequence the context decodes uses them. No mixed batches (llama.cpp's own server, too, batches
  only requests with the same LoRA set): a batch is served one request at a time, each with its
  adapter set on the context; ``max_loras_per_batch`` is 1 and ``mixed_batch`` is not declared.
* Loading and unloading while the context lives (``dynamic_loading``), rsLoRA and rank / alpha
  patterns (expressed by the converter), ``embed_tokens`` and ``lm_head`` LoRA (llama.cpp applies
  LoRA to ``token_embd`` rows and the ``output`` matmul), and prompt logprobs (logits at every
  prompt position) are declared. Whatever llama.cpp itself refuses when loading an adapter (e.g. an
  ``output`` LoRA on a model whose lm_head is tied to ``token_embd``) is its refusal, passed on.
* Not declared: prefix caching (the low-level API keeps no cross-request prompt cache; the plugin
  clears the context's memory before every request), chunked prefill as a standard knob, graphs,
  in-flight lifecycle (one context, served synchronously), encoders (no pooling path here; the
  served mode has one), DoRA / modules_to_save / LoRA biases (GGUF LoRA holds none of them:
  refused by the converter with that reason). MoE (Mixtral) bases and expert LoRA are declared:
  ``llamacpp_convert`` writes them as llama.cpp's expert tensors.
* Precision: ``float32`` writes F32 weights and keeps the KV cache in F32; ``float16`` /
  ``bfloat16`` write F16 / BF16 weights and a KV cache of the same type. LoRA factors stay F32.
  llama.cpp's CPU flash attention (on by default: ``flash_attn=auto``) computes in half precision,
  so in float32 the plugin turns it off (``flash_attn=off``, recorded in the report's settings);
  ``--engine-arg flash_attn=on`` certifies llama.cpp's default path.

Engine args: ``n_threads`` (torch's intra-op threads), ``n_ctx`` (512), ``gguf_cache`` (where
converted files are kept: beside the lora cache's models), ``max_rank`` (256: llama.cpp has no
limit of its own), ``flash_attn`` (``auto`` / ``on`` / ``off``; ``off`` in float32, llama.cpp's
``auto`` otherwise).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import load_tokenizer, read_adapter_info, topk_from_logprobs
from lora_conformance.engines.args import Ignore, Rename, arg
from lora_conformance.engines.args import install_hint
from lora_conformance.engines.llamacpp_convert import gguf_cache, torch_threads
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    UnsupportedFeatureError,
    only,
)
from lora_conformance.types import GenerationRequest, GenerationResult

GGML_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml_type of the KV cache
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type

# Why each capability is not declared (shown in the report).
NOT_DECLARED = {
    Capability.MIXED_BATCH: "adapters are set per context (llama_set_adapters_lora): one adapter set per batch",
    Capability.PREFIX_CACHE: "the low-level API keeps no prompt cache across requests",
    Capability.INFLIGHT_LIFECYCLE: "one context served synchronously: no adapter change while a request runs",
    Capability.CHUNKED_PREFILL: "no chunk-size knob in the plugin (n_ubatch is the whole context)",
    Capability.EMBEDDINGS: "no pooling / encoder path in the offline mode (mode=served has one)",
    Capability.DORA: "GGUF LoRA has no DoRA magnitude vector",
    Capability.MODULES_TO_SAVE: "GGUF LoRA holds no full module copies",
    Capability.LORA_BIAS: "GGUF LoRA holds lora_a / lora_b only",
    Capability.GRAPHS: "no graph capture on the cpu backend",
    Capability.OVERLAP_LOADING: "adapters load synchronously (llama_adapter_lora_init)",
    Capability.PINNING: "no bounded adapter cache: nothing to pin",
    Capability.EVICTION_LRU: "no bounded adapter cache: nothing is evicted",
    Capability.EVICTION_FIFO: "no bounded adapter cache: nothing is evicted",
    Capability.MAX_LOADED: "no bounded adapter cache",
    Capability.TENSOR_PARALLEL: "not exposed by llama-cpp-python's context parameters on cpu",
}

_LOG_LOCK = threading.Lock()
_LOG_TAIL: list[str] = []
_LOG_CALLBACK = None  # keeps the ctypes callback alive


def _install_log_capture(llama_cpp) -> None:
    """llama.cpp's log goes to a short in-memory tail (shown in errors), not to the test's stderr."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @llama_cpp.llama_log_callback
    def _capture(level, text, user_data):  # noqa: ARG001
        with _LOG_LOCK:
            _LOG_TAIL.append(text.decode("utf-8", "replace") if text else "")
            del _LOG_TAIL[:-200]

    _LOG_CALLBACK = _capture
    llama_cpp.llama_log_set(_capture, ctypes.c_void_p())


def _log_since(mark: int) -> str:
    with _LOG_LOCK:
        lines = "".join(_LOG_TAIL[mark:] if mark < len(_LOG_TAIL) else _LOG_TAIL[-5:]).strip().splitlines()
    important = [ln for ln in lines if "error" in ln.lower() or "fail" in ln.lower() or "not" in ln.lower()]
    return "; ".join((important or lines)[-3:])


def _log_mark() -> int:
    with _LOG_LOCK:
        return len(_LOG_TAIL)


@dataclass(frozen=True)
class LlamaCppArgs:
    mode: str = arg("offline", "offline: llama-cpp-python in this process; served: llama.cpp's llama-server "
                               "(engines/llamacpp_server.py, its own args)", choices=("offline", "served"))
    n_threads: Optional[int] = arg(None, "llama.cpp's threads (default: torch's intra-op threads)", minimum=1)
    n_ctx: int = arg(512, "context length: prompt + generated tokens of one request", minimum=16)
    gguf_cache: Optional[str] = arg(None, "where converted GGUF files are kept (default: beside the model's cache)")
    max_rank: int = arg(256, "the largest adapter rank accepted (llama.cpp has no limit of its own)", minimum=1)
    flash_attn: Optional[str] = arg(None, "llama.cpp's flash attention: auto, on or off (default: off in float32, "
                                          "llama.cpp's auto otherwise)", choices=("auto", "on", "off"))
    extra_bufts: bool = arg(True, "llama.cpp's use_extra_bufts: repacked weight buffers (AMX, CPU_REPACK) for quantised "
                                  "weights, llama.cpp's default; off: the plain CPU buffers (docs/quantized-bases.md: "
                                  "the AMX path segfaults in llama_decode on a Q8_0 / Q4_K base on our AMX host)")


CAPABILITIES = frozenset({Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.RANK_PATTERN,
                          Capability.EMBED_TOKENS, Capability.LM_HEAD, Capability.PROMPT_LOGPROBS})


class LlamaCppEngine(Engine):
    name = "llamacpp"
    Args = LlamaCppArgs
    requires = ("llama_cpp", "gguf")
    extra = "llamacpp"
    base_quantizations = {"q8_0": "GGUF Q8_0 blocks written by our converter (llamacpp_convert.QuantizedBase)",
                          "q4_k": "GGUF Q4_K blocks written by our converter (llamacpp_convert.QuantizedBase)"}
    standard_args = {
        "max_loras_per_batch": only(name, "max_loras_per_batch", "1"),
        "max_loaded_loras": Ignore("no bound: adapters stay loaded until unloaded"),
        "max_rank": Rename("max_rank"),
        "eviction": only(name, "eviction", "none"),
        "prefix_cache": only(name, "prefix_cache", "0"),
        "overlap_loading": only(name, "overlap_loading", "0"),
        "graphs": only(name, "graphs", "0"),
        "tensor_parallel": only(name, "tensor_parallel", "1"),
    }

    def __new__(cls, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        """``mode=served`` is llama.cpp's server (``llamacpp_server.LlamaServerEngine``), under this name."""
        if cls is LlamaCppEngine and dict(args).get("mode") == "served":
            from lora_conformance.engines.llamacpp_server import LlamaServerEngine

            return LlamaServerEngine(model_dir, device, dtype, args)
        return super().__new__(cls)

    @classmethod
    def parse_args(cls, raw: Mapping[str, str], source="the engine's arguments"):
        if cls is LlamaCppEngine and dict(raw).get("mode") == "served":
            from lora_conformance.engines.llamacpp_server import LlamaServerEngine

            return LlamaServerEngine.parse_args(raw, source)
        return super().parse_args(raw, source)

    @staticmethod
    def _served(cfg) -> bool:
        return getattr(cfg, "mode", "offline") == "served"

    @classmethod
    def not_declared_reasons(cls, cfg, model_dir: Optional[Path], device: str):
        if cls._served(cfg):
            from lora_conformance.engines import llamacpp_server

            return llamacpp_server.not_declared(cfg, model_dir)
        return {c: why for c, why in NOT_DECLARED.items()}

    @classmethod
    def declared_activations(cls, cfg: LlamaCppArgs, model_dir: Optional[Path], device: str,
                             dtype: Optional[str] = None) -> Optional[str]:
        """ggml's quantised dot products read the activation row quantised to the weight type's
        vec_dot_type (ggml-cpu's type traits: Q8_0 in front of Q8_0 weights, Q8_K in front of Q4_K),
        offline and served alike; there is no knob to keep them float."""
        from lora_conformance.models.quant import gguf_activations

        return gguf_activations(model_dir)

    @classmethod
    def declared_capabilities(cls, cfg: LlamaCppArgs, model_dir: Optional[Path], device: str):
        """None for a model the plugin refuses (MoE, encoders, other architectures): its start says why."""
        if cls._served(cfg):
            from lora_conformance.engines import llamacpp_server

            return llamacpp_server.capabilities(cfg, model_dir)
        if model_dir is not None:
            from lora_conformance.checkpoints import model_kind, read_model_config
            from lora_conformance.engines.llamacpp_convert import ARCHES

            try:
                model_type = read_model_config(model_dir).get("model_type")
            except (OSError, ValueError):
                return None
            kind = model_kind(Path(model_dir))
            if kind not in ("decoder", "moe") or model_type not in ARCHES:
                return None
            if kind == "moe":
                return CAPABILITIES | {Capability.MOE}
        return CAPABILITIES

    @classmethod
    def declared_limits(cls, cfg: LlamaCppArgs, model_dir: Optional[Path], device: str) -> Limits:
        if cls._served(cfg):
            from lora_conformance.engines import llamacpp_server

            return llamacpp_server.limits(cfg)
        return Limits(max_loras_per_batch=1, max_loaded_loras=1024, max_rank=cfg.max_rank)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = a = self.parse_args(self.args)
        try:
            import llama_cpp
            import numpy
        except ImportError as exc:
            raise EngineFailure(f"engine 'llamacpp' needs llama-cpp-python ({exc}): {install_hint(type(self))}") \
                from exc
        from lora_conformance.checkpoints import model_kind
        from lora_conformance.engines import llamacpp_convert

        self._ll, self._np = llama_cpp, numpy
        if dtype not in GGML_TYPES:
            raise EngineError(f"engine 'llamacpp': dtype {dtype!r} is not one of {', '.join(GGML_TYPES)}")
        kind = devices.device_type(device)
        if kind != "cpu" and not llama_cpp.llama_supports_gpu_offload():
            raise UnsupportedFeatureError(f"engine 'llamacpp': this llama.cpp build offloads to no accelerator "
                                          f"(device {device!r}); rebuild llama-cpp-python with that backend")
        if model_kind(self.model_dir) not in ("decoder", "moe"):
            raise UnsupportedFeatureError(f"engine 'llamacpp': {self.model_dir.name} is a {model_kind(self.model_dir)} "
                                          "model; the offline mode serves decoders (llama, qwen2, mixtral); "
                                          "mode=served serves encoders (llama-server --embedding)")
        self.max_rank, self.n_ctx = a.max_rank, a.n_ctx
        self.n_threads = a.n_threads or torch_threads()
        # llama.cpp's default (auto) turns its CPU flash attention on, which computes in half
        # precision: float32 logits then move by ~1e-4 relative (0.07 on the synthetic model's
        # logits, against 2e-4 without it). A float32 certification asks for float32, so flash
        # attention is off there unless asked for; the report's settings say so.
        flash = a.flash_attn or ("off" if dtype == "float32" else "auto")
        self.cache_dir = Path(a.gguf_cache) if a.gguf_cache else gguf_cache(self.model_dir)
        self._convert = llamacpp_convert
        gguf_file = llamacpp_convert.convert_model(self.model_dir, self.cache_dir / "models", dtype)

        _install_log_capture(llama_cpp)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0 if kind == "cpu" else 999
        mp.use_extra_bufts = a.extra_bufts
        mark = _log_mark()
        self._model = llama_cpp.llama_model_load_from_file(str(gguf_file).encode(), mp)
        if not self._model:
            raise EngineFailure(f"engine 'llamacpp': llama.cpp could not load {gguf_file}: {_log_since(mark)}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.type_k = cp.type_v = GGML_TYPES[dtype]
        cp.flash_attn_type = FLASH_ATTN[flash]
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise EngineFailure(f"engine 'llamacpp': llama.cpp could not create a context: {_log_since(mark)}")
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        self._batch = llama_cpp.llama_batch_init(self.n_ctx, 0, 1)
        self.tokenizer = load_tokenizer(self.model_dir)
        self._adapters: "OrderedDict[str, tuple[Path, object]]" = OrderedDict()  # name -> (gguf, adapter ptr)
        self._lock = threading.Lock()
        self._closed = False
        self.capabilities = self.declared_capabilities(a, self.model_dir, device)
        self.limits = self.declared_limits(a, self.model_dir, device)
        self._effective = {"n_ctx": self.n_ctx, "n_threads": self.n_threads, "flash_attn": flash,
                           "kv_cache_type (type_k, type_v)": dtype, "weights": dtype, "lora factors": "float32",
                           "n_gpu_layers": mp.n_gpu_layers, "gguf": gguf_file.name, "use_extra_bufts": a.extra_bufts,
                           "base_quant": self.base_quant}

    # ---- adapters ----------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        from lora_conformance.adapters.validate import validate_name

        validate_name(name)  # llama.cpp has no adapter names: the plugin keeps them, so it checks them
        info = read_adapter_info(path)
        if info.max_rank > self.max_rank:
            raise AdapterIncompatibleError(f"adapter {name!r} ({path}): rank {info.max_rank} > max_rank {self.max_rank}")
        gguf_file = self._convert.convert_adapter(Path(path), self.model_dir, self.cache_dir / "adapters",
                                                  self.max_rank, self.dtype)
        ll = self._ll
        with self._lock:
            mark = _log_mark()
            ptr = ll.llama_adapter_lora_init(self._model, str(gguf_file).encode())
            if not ptr:
                raise AdapterIncompatibleError(
                    f"engine 'llamacpp': llama.cpp refused adapter {name!r} ({path}, converted to {gguf_file.name}): "
                    f"{_log_since(mark)}")
            old = self._adapters.pop(name, None)
            self._adapters[name] = (gguf_file, ptr)
            if old is not None:
                ll.llama_adapter_lora_free(old[1])

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                raise AdapterNotLoadedError(name, list(self._adapters))
            _, ptr = self._adapters.pop(name)
            self._ll.llama_adapter_lora_free(ptr)

    def list_adapters(self) -> list[str]:
        return list(self._adapters)

    # ---- generation --------------------------------------------------------------------

    def _set_adapter(self, name: Optional[str]) -> None:
        ll = self._ll
        if name is None:
            rc = ll.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            ptr = self._adapters[name][1]
            arr = (ll.llama_adapter_lora_p_ctypes * 1)(ptr)
            scales = (ctypes.c_float * 1)(1.0)
            rc = ll.llama_set_adapters_lora(self._ctx, arr, 1, scales)
        if rc != 0:
            raise EngineFailure(f"engine 'llamacpp': llama_set_adapters_lora returned {rc}")

    def _decode(self, tokens: Sequence[int], start: int, all_logits: bool) -> None:
        b = self._batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (all_logits or i == len(tokens) - 1) else 0
        mark = _log_mark()
        rc = self._ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise EngineFailure(f"engine 'llamacpp': llama_decode returned {rc}: {_log_since(mark)}")

    def _logprobs(self, i: int):
        np = self._np
        logits = np.ctypeslib.as_array(self._ll.llama_get_logits_ith(self._ctx, i), shape=(self._n_vocab,))
        x = logits.astype(np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    def _serve(self, req: GenerationRequest) -> GenerationResult:
        import torch

        ids = list(self.tokenizer(req.prompt)["input_ids"])
        if len(ids) + req.max_new_tokens > self.n_ctx:
            raise EngineFailure(f"engine 'llamacpp': {len(ids)} prompt + {req.max_new_tokens} new tokens > n_ctx "
                                f"{self.n_ctx}")
        self._ll.llama_memory_clear(self._ll.llama_get_memory(self._ctx), True)
        self._set_adapter(req.adapter)
        self._decode(ids, 0, all_logits=req.prompt_logprobs)
        prompt_lps = None
        if req.prompt_logprobs:
            # Position p predicts token p+1: the last prompt position predicts the first output.
            prompt_lps = [topk_from_logprobs(torch.from_numpy(self._logprobs(p)), req.top_k)
                          for p in range(len(ids) - 1)]
        out, tops = [], []
        last = len(ids) - 1
        for step in range(req.max_new_tokens):
            row = torch.from_numpy(self._logprobs(last if step == 0 else 0))
            top = topk_from_logprobs(row, max(req.top_k, 1))
            tid = next(iter(top))  # greedy; ties go to the lower id, as the reference's argmax
            out.append(tid)
            tops.append(dict(list(top.items())[: req.top_k]))
            if not req.ignore_eos and tid == self.tokenizer.eos_token_id:
                break
            if step + 1 < req.max_new_tokens:
                self._decode([tid], len(ids) + step, all_logits=False)
        return GenerationResult(token_ids=out, text=self.tokenizer.decode(out, skip_special_tokens=True),
                                logprobs=tops, prompt_token_ids=ids, prompt_logprobs=prompt_lps)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.require_loaded(requests)
        with self._lock:
            if self._closed:
                raise EngineFailure("engine 'llamacpp' is closed")
            return [self._serve(r) for r in requests]

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ll = self._ll
            for _, ptr in self._adapters.values():
                ll.llama_adapter_lora_free(ptr)
            self._adapters.clear()
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
            ll.llama_model_free(self._model)

    def version(self) -> str:
        return f"llama-cpp-python {self._ll.__version__} (llama.cpp, {self._effective['gguf']})"

    def settings(self) -> dict:
        """Every effective setting, each of ours that differs from llama.cpp's default (with the
        reason), and why each capability is not declared."""
        differs = {"type_k / type_v": {"ours": self.dtype, "engine_default": "float16",
                                       "why": "the KV cache in the precision being certified"}}
        if self._effective["flash_attn"] != "auto":
            differs["flash_attn"] = {"ours": self._effective["flash_attn"], "engine_default": "auto",
                                     "why": "llama.cpp's CPU flash attention computes in half precision"}
        if not self._effective["use_extra_bufts"]:
            differs["use_extra_bufts"] = {"ours": False, "engine_default": True,
                                          "why": "asked for (engine arg extra_bufts=0): llama.cpp's AMX buffers segfault "
                                                 "on a quantised base on this host (ggml-org/llama.cpp#20824)"}
        return {"effective": dict(self._effective), "differs_from_engine_default": differs,
                "not_declared": {c.value: why for c, why in NOT_DECLARED.items()}}
