"""The ``openvino`` engine: OpenVINO GenAI's ``ContinuousBatchingPipeline`` serving PEFT LoRA adapters.

The base model and its tokenizer are converted to OpenVINO IR once (``openvino_convert``) and
served with GenAI's own tokenizer. Two modes (engine arg ``mode``): ``generate`` (below: one
``generate()`` call per adapter) and ``continuous_batching`` (``openvino_cb.py``: every request
through ``add_request()`` with its own adapters while others run; it declares ``mixed_batch`` and
``inflight_lifecycle``; docs/openvino.md). What GenAI offers, and so what this plugin declares
(openvino-genai 2026.4, read from its source and checked here; ``NOT_DECLARED`` holds the evidence
for what is not):

* Adapters are ``openvino_genai.Adapter`` objects read from ``adapter_model.safetensors``;
  GenAI ignores ``adapter_config.json`` and scales an Adapter by the alpha it is given, so the
  plugin passes PEFT's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) as that alpha.
  Where ``rank_pattern`` / ``alpha_pattern`` give modules different scalings, the file's tensors
  are split by scaling into one Adapter each, every one with its own alpha, all in the request's
  ``AdapterConfig`` (GenAI's multi-adapter blending; ``openvino_adapters``).
* The pipeline binds LoRA tensors to the modules of the adapters it was *created* with; an
  adapter that targets a module no earlier adapter targeted needs a new pipeline, which the
  plugin builds (with every loaded adapter) when that happens.
* One adapter configuration per ``generate`` call ("LoRA adapters value must be the same for all
  requests"): no mixed batches. A batch is served as one ``generate`` call per adapter (the base
  being one of them); ``max_loras_per_batch`` is 1.
* Logprobs: greedy decoding reports only the chosen token's (GenAI's ``logprobs`` > 1 is treated
  as 1), and only through ``add_request`` / ``step`` handles, not from ``generate``. ``add_request``
  does not apply the request's adapters (only ``generate`` does; the state stays applied
  afterwards), so each group is first served by ``generate`` and then again through handles for
  the per-token logprobs; the two runs must give the same tokens and the same total logprob
  (GenAI's score), or the batch fails with EngineFailure. Each step's top-k is therefore the
  chosen token alone, except for a one-token request asking for top_k > 1 (the suites'
  teacher-forced checks): that one is served by one step of beam search with top_k beams, whose
  scores (length_penalty 0) are exactly the top_k logprobs of the first token. Prompt
  logprobs (``echo``) hold only each prompt token's own logprob, not the distribution's top-k:
  no ``prompt_logprobs`` capability.
* GenAI gets every adapter the plugin can express; what GenAI does with DoRA (it drops the
  magnitude vector), ``modules_to_save``, LoRA biases and ``embed_tokens`` LoRA (its name
  patterns do not know PEFT's ``lora_embedding_A/B`` keys and skip them silently) is what the
  suites judge. What the plugin still refuses, and the GenAI behaviour each refusal stands for:
  encoder base models (GenAI's TextEmbeddingPipeline
  takes no adapters; Mixtral MoE bases are converted and expert LoRA goes to GenAI); float16 on a CPU without FP16 support (OpenVINO reports
  no FP16 in ``OPTIMIZATION_CAPABILITIES``); an ``adapter_config.json`` that cannot be read (the
  alphas are computed from it, so ``r`` must be positive); and ranks above the ``max_rank`` arg
  (a deployment's setting). Malformed
  weights files reach GenAI (engine arg ``validate_adapters=1`` runs the shared validator first, a
  configuration, not GenAI's behaviour): what GenAI accepts, refuses or crashes on is what the
  bad-input suite records.
* Pipelines: GenAI binds LoRA to MatMuls when a pipeline is built. The plugin builds a new one
  (every loaded adapter in its ``AdapterConfig``) only when an adapter carries LoRA for a module
  the current pipeline has not bound; otherwise the adapter reaches GenAI per request
  (``GenerationConfig.adapters``), which GenAI accepts. The two paths differ for ``modules_to_save``:
  GenAI serves the saved module copy only for an adapter given at the build (the expectations file
  shows both runs); which path a test meets depends on the adapters loaded before it.
* ``prefix_cache=1`` turns on GenAI's prefix caching (``SchedulerConfig.enable_prefix_caching``, off by
  default as in GenAI); the capability is declared, and the suites ask for it.

Engine args: ``OpenVINOArgs`` below (``lora-conformance engines describe openvino``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines._hf_common import AdapterInfo, read_adapter_info
from lora_conformance.engines.args import Ignore, Rename, arg
from lora_conformance.engines.args import install_hint
from lora_conformance.engines.base import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    AdaptersInUse,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    RequestHandle,
    UnsupportedFeatureError,
    only,
)
from lora_conformance.engines.openvino_adapters import WEIGHTS, adapter_modules, adapter_scaling, genai_pairs
from lora_conformance.types import GenerationRequest, GenerationResult

PRECISIONS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
CAPABILITY_NAMES = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}  # OPTIMIZATION_CAPABILITIES
SCORE_ATOL = 1e-3  # generate()'s score vs the sum of the handles' per-token logprobs
UNSPLIT_BATCHED_TOKENS = 8192  # chunked_prefill_size=0: tokens a step may take (whole prompts)


def openvino_device(device: str) -> str:
    """Our device string -> OpenVINO's device name: cpu -> CPU, xpu[:N]/gpu[:N] -> GPU[.N], npu -> NPU."""
    kind = devices.device_type(device)
    index = device.split(":", 1)[1] if ":" in device else None
    if kind == "cpu":
        return "CPU"
    name = devices.OPENVINO_PLUGINS.get(kind)
    if name == "GPU" and index is not None:
        return f"GPU.{index}"
    if name is not None:
        return name
    raise UnsupportedFeatureError(f"engine 'openvino': device {device!r} has no OpenVINO plugin (cpu, xpu/gpu, npu)")


def _one_step_top_k(request: GenerationRequest) -> bool:
    """A one-token request asking for more than the chosen token's logprob: served by one beam step."""
    return request.max_new_tokens == 1 and request.top_k > 1


MODES = ("generate", "continuous_batching")
# GenAI's ways of applying LoRA (AdapterConfig::Mode, lora_adapter.hpp#L52-L58): the backends suite runs each.
ADAPTER_MODES = {"auto": "MODE_AUTO", "dynamic": "MODE_DYNAMIC", "static_rank": "MODE_STATIC_RANK",
                 "static": "MODE_STATIC", "fuse": "MODE_FUSE"}
# How the model runs: OpenVINO compiles it once per pipeline (pipeline_impl.cpp#L182) and runs only
# that; there is no eager or graph-capture mode beside it (NOT_DECLARED[GRAPHS]).
EXEC_MODES = ("compiled",)
DEFAULT_CB_LORAS_PER_BATCH = 4  # what mode=continuous_batching declares unless told (GenAI has no limit)

# Why a capability is not declared, with GenAI's own evidence (openvino.genai master da1db864,
# version 2026.4.0.0 in its pyproject; the installed 2026.4.1 behaves alike where tests here show it).
GENAI = "https://github.com/openvinotoolkit/openvino.genai/blob/da1db864d2bc1a265e9a036f5b57ef13f0e86c2c/"
_HPP = f"{GENAI}src/cpp/include/openvino/genai/"
_CB = f"{GENAI}src/cpp/src/continuous_batching/pipeline_impl.cpp"
# What a bounded adapter cache, its slots, pins and evictions would be in GenAI: there is none.
_NO_BOUND = (f"GenAI has no adapter slots, capacity, pins or eviction: an AdapterConfig is a vector of adapters and "
             f"their alphas with add / remove and nothing else ({_HPP}lora_adapter.hpp#L88-L111), the pipeline "
             f"keeps the one it was built with ({_CB}#L166-L172) and add_request takes any ({_CB}#L292-L351): "
             "nothing is ever full, evicted or pinned, so there is no limit to exceed")
NOT_DECLARED_GENERATE = {
    Capability.MIXED_BATCH: (
        "mode=generate: GenAI's ContinuousBatchingPipeline.generate() asserts that all requests of a call carry the "
        f"same adapters ({GENAI}src/cpp/src/continuous_batching/pipeline_impl.cpp#L570-L575; openvino-genai "
        "2026.4.1's message names pipeline_impl.cpp:697), so this mode serves one call per adapter; "
        "mode=continuous_batching submits per-request adapters"),
    Capability.INFLIGHT_LIFECYCLE: (
        "mode=generate: generate() asserts that no request is running "
        f"({GENAI}src/cpp/src/continuous_batching/pipeline_impl.cpp#L553-L555); mode=continuous_batching "
        "adds requests while others run (add_request / step)"),
}
NOT_DECLARED = {
    Capability.MAX_LOADED: _NO_BOUND,
    Capability.PINNING: _NO_BOUND,
    Capability.EVICTION_LRU: _NO_BOUND,
    Capability.EVICTION_FIFO: _NO_BOUND,
    Capability.OVERLAP_LOADING: (
        "GenAI has no asynchronous adapter loading to switch on or off: Adapter(path) reads the file when constructed "
        f"({GENAI}src/cpp/src/lora/adapter.cpp#L1260), set_adapters computes and sets the LoRA state of the infer "
        f"request synchronously before a generate ({_CB}#L535-L538; the state evaluation runs request.infer(), "
        f"'TODO: Consider using async', {GENAI}src/cpp/src/lora/adapter.cpp#L819)"),
    Capability.GRAPHS: (
        "OpenVINO compiles the whole model once when the pipeline is built "
        f"({_CB}#L182) and runs only that compiled model: there is no eager mode to compare"),
    Capability.TENSOR_PARALLEL: (
        "GenAI's continuous batching on CPU runs on one execution device: 'execution device is expected to be single "
        f"CPU / single GPU / multi GPUs' ({_CB}#L183-L189): several execution devices only when all are GPUs"),
    Capability.EMBEDDINGS: (
        "GenAI's TextEmbeddingPipeline takes no adapters: embed_documents / embed / embed_query take texts only "
        f"({_HPP}rag/text_embedding_pipeline.hpp#L162-L192) and src/cpp/src/rag/ has no LoRA code "
        "(git grep -i 'lora\\|adapter' there finds nothing)"),
    Capability.PROMPT_LOGPROBS: (
        "GenAI returns one logprob per prompt token, the token's own: _fill_prompt_log_probs appends "
        f"token_logit - max - log_sum for the prompt's next id only ({_CB}#L967-L1034), and "
        f"GenerationConfig.logprobs: 'Currently only single top logprob can be returned' ({_HPP}generation_config.hpp"
        "#L583); the prompt-logprob judgement needs the distribution's top-k (3 ids at least) at each position"),
    Capability.DORA: ("GenAI reads only the LoRA A/B tensors of adapter_model.safetensors; the DoRA magnitude is "
                      f"skipped ({GENAI}src/cpp/src/lora/adapter.cpp): judged by matches_or_refuses"),
    Capability.MODULES_TO_SAVE: ("GenAI reads only LoRA tensors per request; a modules_to_save copy is served only "
                                 "from a pipeline built with the adapter: judged by matches_or_refuses"),
    Capability.LORA_BIAS: (f"GenAI skips lora_B biases ({GENAI}src/cpp/src/lora/adapter.cpp): judged by "
                           "matches_or_refuses"),
}


@dataclass(frozen=True)
class OpenVINOArgs:
    mode: str = arg("generate", "generate: one GenAI generate() call per adapter (GenAI's one adapter configuration "
                                "per call); continuous_batching: every request through add_request() with its own "
                                "adapters, stepped by a serving loop while others run", choices=MODES)
    prefix_cache: bool = arg(False, "GenAI's SchedulerConfig.enable_prefix_caching (off by default, as in GenAI)")
    chunked_prefill_size: Optional[int] = arg(
        None, "SchedulerConfig.max_num_batched_tokens with dynamic_split_fuse (prompt tokens per step); 0: no split "
              "(dynamic_split_fuse off); default: GenAI's (256, split on)", minimum=0)
    max_loras_per_batch: Optional[int] = arg(
        None, f"adapters declared per batch: mode=generate serves 1 (the default); mode=continuous_batching takes any "
              f"(GenAI's add_request has no limit; default {DEFAULT_CB_LORAS_PER_BATCH})", minimum=1)
    lora_backend: str = arg("auto", "GenAI's AdapterConfig mode for the pipeline's adapters (lora_adapter.hpp's "
                                    "AdapterConfig::Mode): auto, dynamic, static_rank, static or fuse",
                            choices=tuple(ADAPTER_MODES))
    cache_size_gb: int = arg(1, "the KV cache, GiB (SchedulerConfig.cache_size)", minimum=1)
    num_threads: Optional[int] = arg(None, "INFERENCE_NUM_THREADS (default: the device's)", minimum=1)
    ir_cache: Optional[str] = arg(None, "where converted models are kept (default: beside the model's cache)")
    max_rank: int = arg(256, "the largest adapter rank accepted (GenAI has no limit of its own)", minimum=1)
    dynamic_quantization: Optional[str] = arg(
        None, "the CPU plugin's dynamic quantization of activations for compressed weights (DYNAMIC_QUANTIZATION_"
              "GROUP_SIZE): on (the plugin's default) or off; default: off for a quantised base in float32, "
              "the plugin's own otherwise", choices=("on", "off"))
    validate_adapters: bool = arg(False, "check adapters with the shared validator before GenAI sees them (off: "
                                         "GenAI's own behaviour is what is certified)")
    request_timeout_s: float = arg(600.0, "mode=continuous_batching: how long generate() waits for its requests",
                                   minimum=1)
    exec_mode: str = arg("compiled", "how the model runs: compiled once when the pipeline is built and that compiled "
                                     "model run for every step (GenAI's compile_model, pipeline_impl.cpp#L182); "
                                     "OpenVINO has no other mode", choices=EXEC_MODES)

    def __post_init__(self):
        if self.mode == "generate" and self.max_loras_per_batch not in (None, 1):
            raise UnsupportedFeatureError(
                f"engine 'openvino' cannot run with max_loras_per_batch={self.max_loras_per_batch} in mode=generate "
                "(GenAI's generate() takes one adapter configuration per call; mode=continuous_batching takes "
                "per-request adapters)")

    @property
    def loras_per_batch(self) -> int:
        if self.mode == "generate":
            return 1
        return self.max_loras_per_batch or DEFAULT_CB_LORAS_PER_BATCH


class OpenVINOEngine(Engine):
    name = "openvino"
    Args = OpenVINOArgs
    requires = ("openvino", "openvino_genai")
    extra = "openvino"
    base_quantizations = {"ov_int8": "u8 codes, zero points and scales in OpenVINO's weight-compression subgraph "
                                     "(openvino_convert.compress_weights)",
                          "ov_int4": "u4 codes in groups of 128, zero points and scales in OpenVINO's weight-compression "
                                     "subgraph (openvino_convert.compress_weights)"}
    standard_args = {
        "max_loras_per_batch": Rename("max_loras_per_batch"),
        "max_loaded_loras": Ignore("no bound: every loaded adapter stays on the host"),
        "max_rank": Rename("max_rank"),
        "eviction": only(name, "eviction", "none"),
        "prefix_cache": Rename("prefix_cache"),
        "overlap_loading": only(name, "overlap_loading", "0"),
        "graphs": only(name, "graphs", "0"),
        "chunked_prefill_size": Rename("chunked_prefill_size"),
        "lora_backend": Rename("lora_backend"),
    }

    @classmethod
    def declared_activations(cls, cfg: OpenVINOArgs, model_dir: Optional[Path], device: str,
                             dtype: Optional[str] = None) -> Optional[str]:
        """With dynamic_quantization=on in float32 on a compressed base (ov_int8, ov_int4): the CPU plugin
        quantises the activations of each compressed-weight FullyConnected to 8-bit groups of 32
        (symmetric, float32 scale; only for f32 sources: its executors refuse the rest), which
        bench/openvino_dynamic_quant.py shows bit-exact. The LoRA's matmuls (float weights) read them as
        they are. Our default turns it off for a quantised base in float32 (then None)."""
        from lora_conformance.models.quant import quantised_scheme

        on = cfg.dynamic_quantization == "on" and dtype == "float32"
        return "ov_dq32" if on and quantised_scheme(model_dir) in cls.base_quantizations else None

    @classmethod
    def declared_capabilities(cls, cfg: OpenVINOArgs, model_dir: Optional[Path], device: str):
        """None for a model the converter refuses (MoE, encoders, ...): the engine's start says why."""
        from lora_conformance.engines.openvino_convert import check_convertible

        moe = False
        if model_dir is not None:
            try:
                moe = bool(check_convertible(Path(model_dir)).get("num_local_experts"))
            except UnsupportedFeatureError:
                return None
        # prefix_cache: GenAI has one (off unless asked for, as in its SchedulerConfig); the suites
        # ask for it with prefix_cache=1. embed_tokens: GenAI accepts such adapters (it loads the
        # file and applies what its name patterns know), so what it serves is judged. chunked
        # prefill: SchedulerConfig.dynamic_split_fuse / max_num_batched_tokens, in both modes. rslora
        # and rank_pattern: PEFT's scaling per module as GenAI's alphas (openvino_adapters).
        caps = {Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.RANK_PATTERN, Capability.LM_HEAD,
                Capability.PREFIX_CACHE, Capability.EMBED_TOKENS, Capability.CHUNKED_PREFILL}
        if moe:  # a Mixtral IR; expert LoRA (target_parameters) goes to GenAI as the file holds it
            caps.add(Capability.MOE)
        if cfg.mode == "continuous_batching":
            # GenAI's request API takes per-request adapters while others run (openvino_cb.py says
            # what GenAI then serves; the suites judge it).
            caps |= {Capability.MIXED_BATCH, Capability.INFLIGHT_LIFECYCLE}
        return frozenset(caps)

    @classmethod
    def not_declared_reasons(cls, cfg: OpenVINOArgs, model_dir: Optional[Path], device: str):
        reasons = dict(NOT_DECLARED)
        if cfg.mode == "generate":
            reasons.update(NOT_DECLARED_GENERATE)
        return reasons

    @classmethod
    def backends(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """GenAI's LoRA modes other than auto (which picks one of them: dynamic on CPU and GPU)."""
        return {"lora_backend": tuple(m for m in ADAPTER_MODES if m != "auto")}

    @classmethod
    def exec_modes(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """The one way OpenVINO runs a model: compiled (the runtime-modes suite serves it mixed batches
        of changing sizes and adapter mixes, each reusing the one compiled model and its LoRA state)."""
        return {"exec_mode": EXEC_MODES}

    @classmethod
    def declared_limits(cls, cfg: OpenVINOArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(max_loras_per_batch=cfg.loras_per_batch, max_loaded_loras=1024, max_rank=cfg.max_rank)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = a = self.parse_args(self.args)
        try:
            import openvino as ov
            import openvino_genai
        except ImportError as exc:
            raise EngineFailure(f"engine 'openvino' needs openvino-genai installed ({exc}): "
                                f"{install_hint(type(self))}") from exc
        from lora_conformance.engines.openvino_convert import check_convertible, converted_model

        self._genai = openvino_genai
        self.ov_device = openvino_device(device)
        if dtype not in PRECISIONS:
            raise EngineError(f"engine 'openvino': dtype {dtype!r} is not one of {', '.join(PRECISIONS)}")
        core = ov.Core()
        if self.ov_device.split(".")[0] not in core.available_devices:
            raise UnsupportedFeatureError(f"engine 'openvino': OpenVINO sees no {self.ov_device} device "
                                          f"(available: {', '.join(core.available_devices)})")
        caps = core.get_property(self.ov_device, "OPTIMIZATION_CAPABILITIES")
        if CAPABILITY_NAMES[dtype] not in caps:
            raise UnsupportedFeatureError(f"engine 'openvino': {self.ov_device} cannot compute in {dtype} "
                                          f"(its OPTIMIZATION_CAPABILITIES: {', '.join(caps)})")
        check_convertible(self.model_dir)  # refuses MoE / encoders before anything is converted
        self.prefix_cache, self.cache_size_gb, self.num_threads, self.max_rank = (
            a.prefix_cache, a.cache_size_gb, a.num_threads, a.max_rank)
        # OpenVINO's CPU plugin quantises activations to int8 (groups of 32) for compressed weights by
        # default: float32 logits of the synthetic model then move by 0.63, against 8.5e-4 with it off
        # (docs/quantized-bases.md). A float32 certification asks for float32 arithmetic on the stored
        # weights, so it is off there unless asked for, as llama.cpp's flash attention is.
        dq = a.dynamic_quantization or ("off" if self.base_quant != "none" and dtype == "float32" else None)
        self._plugin_props = {} if dq != "off" else {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
        self.ir_dir = converted_model(self.model_dir, Path(a.ir_cache) if a.ir_cache else _ir_cache(self.model_dir))
        self._matmuls = _matmul_names(core, self.ir_dir / "openvino_model.xml")
        # name -> (AdapterInfo, its (openvino_genai.Adapter, alpha) pairs: openvino_adapters.genai_pairs)
        self._adapters: "OrderedDict[str, tuple[AdapterInfo, list[tuple[object, float]]]]" = OrderedDict()
        self._bound: set[str] = set()  # modules the current pipeline carries LoRA state for
        self._pipe = None
        self._build_pipeline()
        self._loop = None  # mode=continuous_batching: the serving loop that steps the pipeline
        self._in_use = AdaptersInUse()
        if a.mode == "continuous_batching":
            from lora_conformance.engines.openvino_cb import ServingLoop

            self._loop = ServingLoop(lambda: self._pipe, self.name)
        self.capabilities = self.declared_capabilities(a, self.model_dir, device)
        self.limits = self.declared_limits(a, self.model_dir, device)

    # ---- pipeline ----------------------------------------------------------------------

    def _build_pipeline(self) -> None:
        g = self._genai
        sched = g.SchedulerConfig()
        sched.cache_size = self.cache_size_gb
        sched.enable_prefix_caching = self.prefix_cache
        chunk = self.cfg.chunked_prefill_size
        if chunk == 0:  # no split: a step takes whole prompts (GenAI refuses one longer than the batch)
            sched.dynamic_split_fuse = False
            sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, UNSPLIT_BATCHED_TOKENS)
        elif chunk is not None:
            sched.dynamic_split_fuse = True
            sched.max_num_batched_tokens = chunk
        precision = PRECISIONS[self.dtype]
        props: dict = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision, **self._plugin_props}
        if self.num_threads:
            props["INFERENCE_NUM_THREADS"] = self.num_threads
        if self._adapters:
            config = g.AdapterConfig(getattr(g.AdapterConfig.Mode, ADAPTER_MODES[self.cfg.lora_backend]))
            for _, pairs in self._adapters.values():
                for adapter, alpha in pairs:
                    config.add(adapter, alpha)
            props["adapters"] = config
        self._pipe = None  # release the old one first
        try:
            self._pipe = g.ContinuousBatchingPipeline(str(self.ir_dir), sched, self.ov_device, props)
        except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError and its own types
            raise EngineFailure(f"engine 'openvino': cannot create the pipeline for {self.ir_dir}: {exc}") from exc
        self._tokenizer = self._pipe.get_tokenizer()
        self._bound = set().union(*(adapter_modules(info.path) for info, _ in self._adapters.values()))

    # ---- adapters ----------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        # pinned is accepted and meaningless: nothing is ever evicted here. The shared validator runs
        # only when asked (engine arg validate_adapters): GenAI's own handling of a malformed file is
        # what is certified.
        if self.cfg.validate_adapters:
            from lora_conformance.adapters.validate import validate_adapter, validate_name

            validate_name(name)
            validate_adapter(Path(path), self.model_dir, self.max_rank, self.dtype)
        info = read_adapter_info(Path(path))  # the alphas need the config (AdapterFormatError if unreadable)
        if info.max_rank > self.max_rank:
            raise AdapterIncompatibleError(f"adapter {name!r} from {info.path}: rank {info.max_rank} exceeds "
                                           f"max_rank {self.max_rank}")
        adapter_scaling(info)  # r > 0 (the alpha), checked before GenAI reads the file
        try:  # GenAI reads the weights file first: what it refuses, it refuses itself
            whole = self._genai.Adapter(str(info.path / WEIGHTS))
        except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError and its own types
            raise AdapterIncompatibleError(f"adapter {name!r} from {path}: OpenVINO GenAI cannot read it: {exc}") from exc
        try:  # per-module scaling (rank_pattern / alpha_pattern): one Adapter per scaling
            pairs = genai_pairs(self._genai, info, whole)
        except AdapterFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError and its own types
            raise AdapterIncompatibleError(f"adapter {name!r} from {path}: GenAI read the weights file, but it cannot "
                                           f"be split by PEFT's per-module scaling: {exc}") from exc
        try:
            modules = adapter_modules(info.path)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
            raise AdapterIncompatibleError(f"adapter {name!r} from {path}: GenAI read the weights file, but its "
                                           f"tensor names (to bind them to MatMuls) cannot be read: {exc}") from exc
        # Tensors for a module the converted model has no MatMul for are GenAI's to skip or refuse
        # (it matches names to MatMuls itself); only bindable modules decide on a new pipeline.
        modules = {m for m in modules if any(m in mm for mm in self._matmuls)}
        if self._loop is not None:
            # Running requests keep the weights their name had at submission: a reload waits for them.
            self._in_use.wait_unused(name, None)
            if not modules <= self._bound:  # a new pipeline: only once nothing runs on the old one
                self._loop.exclusive(lambda: self._replace(name, info, pairs, modules, path))
                return
        self._replace(name, info, pairs, modules, path)

    def _replace(self, name: str, info: AdapterInfo, pairs: list, modules: set[str], path: Path) -> None:
        old = self._adapters.pop(name, None)
        self._adapters[name] = (info, pairs)
        if not modules <= self._bound:
            try:
                self._build_pipeline()
            except EngineFailure as exc:  # GenAI refused the pipeline with this adapter: restore the one before
                del self._adapters[name]
                if old is not None:
                    self._adapters[name] = old
                self._build_pipeline()
                raise AdapterIncompatibleError(f"adapter {name!r} from {path}: GenAI cannot build a pipeline "
                                               f"with it: {exc}") from exc

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoadedError(name, self.list_adapters())
        self._in_use.wait_unused(name, None)  # mode=continuous_batching: requests using it finish first
        self._adapters.pop(name, None)

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    # ---- generation --------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self._loop is not None:
            return self.submit(requests).result(self.cfg.request_timeout_s)
        self.require_loaded(requests)
        if any(r.prompt_logprobs for r in requests):
            raise UnsupportedFeatureError("engine 'openvino': GenAI returns no prompt top-k logprobs")
        groups: "OrderedDict[Optional[str], list[int]]" = OrderedDict()
        for i, r in enumerate(requests):
            groups.setdefault(r.adapter, []).append(i)
        results: list[Optional[GenerationResult]] = [None] * len(requests)
        for adapter, rows in groups.items():
            for i, result in zip(rows, self._generate_group(adapter, [requests[i] for i in rows])):
                results[i] = result
        return results  # type: ignore[return-value]

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestHandle:
        """mode=continuous_batching: every request enters GenAI's running batch with add_request(),
        its GenerationConfig carrying its own adapters; the serving loop steps the pipeline."""
        if self._loop is None:
            return super().submit(requests)
        self.require_loaded(requests)
        if any(r.prompt_logprobs for r in requests):
            raise UnsupportedFeatureError("engine 'openvino': GenAI returns no prompt top-k logprobs")
        items = []
        for r in requests:
            ids = self._tokenizer.encode(r.prompt).input_ids
            items.append((r, ids, self._config(r, r.adapter), r.adapter, _one_step_top_k(r)))
        names = [r.adapter for r in requests if r.adapter is not None]
        self._in_use.started(names)
        try:
            flights = self._loop.submit(items, self._served)
        except BaseException:
            self._in_use.finished(names)
            raise
        self._in_use.finished_with([f.future for f in flights], names)
        return self._loop.handle(flights)

    def _served(self, f) -> GenerationResult:
        """The result of one request the serving loop finished (openvino_cb.InFlight)."""
        req, ids = f.request, f.input_ids
        if f.beam:
            seqs = [x for _, x in f.beams]
            if len(seqs) != req.top_k or any(len(x) != 1 for x in seqs) or len({x[0] for x in seqs}) != len(seqs):
                raise EngineFailure(f"engine 'openvino': request {f.index} (adapter={f.adapter or 'base'}): one beam "
                                    f"step gave {seqs}, expected {req.top_k} distinct one-token sequences")
            ranked = sorted(((sc, x[0]) for sc, x in f.beams), key=lambda p: (-p[0], p[1]))
            tokens, logprobs = [ranked[0][1]], [{t: sc for sc, t in ranked}]
        else:
            if len(f.logprobs) != len(f.tokens):
                raise EngineFailure(f"engine 'openvino': request {f.index}: GenAI gave {len(f.tokens)} tokens and "
                                    f"{len(f.logprobs)} logprobs")
            tokens, logprobs = f.tokens, [{t: lp} for t, lp in zip(f.tokens, f.logprobs)]
        return GenerationResult(
            token_ids=tokens,
            text=self._tokenizer.decode(tokens, skip_special_tokens=True),
            logprobs=logprobs,
            prompt_token_ids=[int(x) for x in ids.data[0]],
            prompt_logprobs=None,
        )

    def _config(self, request: GenerationRequest, adapter: Optional[str]):
        g = self._genai
        cfg = g.GenerationConfig()
        cfg.max_new_tokens = request.max_new_tokens
        cfg.ignore_eos = request.ignore_eos
        if _one_step_top_k(request):
            # One step of beam search with k beams ranks the k best first tokens by their logprob:
            # score = logprob / length**length_penalty, and length_penalty 0 leaves it as it is.
            cfg.num_beams = cfg.num_return_sequences = request.top_k
            cfg.length_penalty = 0.0
        else:
            cfg.do_sample = False
            cfg.logprobs = 1
        if adapter is None:
            cfg.adapters = g.AdapterConfig()  # explicitly none: unset would mean "the pipeline's default"
        else:
            _, pairs = self._adapters[adapter]
            cfg.adapters = g.AdapterConfig(pairs)
        return cfg

    def _generate_group(self, adapter: Optional[str], requests: list[GenerationRequest]) -> list[GenerationResult]:
        pipe = self._pipe
        ids = [self._tokenizer.encode(r.prompt).input_ids for r in requests]
        configs = [self._config(r, adapter) for r in requests]
        greedy = [k for k, r in enumerate(requests) if not _one_step_top_k(r)]
        try:
            served = pipe.generate(ids, configs)  # applies this group's adapter configuration
            handles = {k: pipe.add_request(k, ids[k], configs[k]) for k in greedy}
            while pipe.has_non_finished_requests():
                pipe.step()
            traced = {k: h.read_all()[0] for k, h in handles.items()}
        except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError and its own types (ParameterMismatch, ...)
            raise EngineFailure(f"engine 'openvino': generation failed: {type(exc).__name__}: {exc}") from exc
        out = []
        for k, (req, s) in enumerate(zip(requests, served)):
            if k in traced:
                tokens, logprobs = self._greedy_result(k, adapter, s, traced[k])
            else:
                tokens, logprobs = self._beam_result(k, adapter, req, s)
            out.append(GenerationResult(
                token_ids=tokens,
                text=self._tokenizer.decode(tokens, skip_special_tokens=True),
                logprobs=logprobs,
                prompt_token_ids=[int(x) for x in ids[k].data[0]],
                prompt_logprobs=None,
            ))
        return out

    @staticmethod
    def _greedy_result(k: int, adapter: Optional[str], served, traced) -> tuple[list[int], list[dict]]:
        tokens, logprobs = [int(x) for x in traced.generated_ids], [float(x) for x in traced.generated_log_probs]
        if tokens != list(served.m_generation_ids[0]) or abs(sum(logprobs) - served.m_scores[0]) > SCORE_ATOL:
            raise EngineFailure(
                f"engine 'openvino': request {k} (adapter={adapter or 'base'}): the logprob pass gave tokens "
                f"{tokens} (logprob sum {sum(logprobs):.5f}), generate() gave {list(served.m_generation_ids[0])} "
                f"(score {served.m_scores[0]:.5f}): the adapter state did not carry over")
        return tokens, [{t: lp} for t, lp in zip(tokens, logprobs)]

    @staticmethod
    def _beam_result(k: int, adapter: Optional[str], req: GenerationRequest, served) -> tuple[list[int], list[dict]]:
        seqs = [list(x) for x in served.m_generation_ids]
        if len(seqs) != req.top_k or any(len(x) != 1 for x in seqs) or len({x[0] for x in seqs}) != len(seqs):
            raise EngineFailure(f"engine 'openvino': request {k} (adapter={adapter or 'base'}): one beam step gave "
                                f"{seqs}, expected {req.top_k} distinct one-token sequences")
        ranked = sorted(((float(sc), int(x[0])) for sc, x in zip(served.m_scores, seqs)), key=lambda p: (-p[0], p[1]))
        return [ranked[0][1]], [{t: sc for sc, t in ranked}]

    # ---- misc ----------------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_loop", None) is not None:
            self._loop.close()
            self._loop = None
        self._pipe = None
        self._adapters.clear()

    def settings(self) -> dict:
        """The pipeline's plugin properties, and where ours differ from OpenVINO's defaults."""
        differs = {}
        if self._plugin_props:
            differs["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = {
                "ours": 0, "engine_default": "the CPU plugin's (32 on this build)",
                "why": "the plugin quantises activations to int8 for compressed weights; a float32 certification of "
                       "a quantised base asks for float32 arithmetic (--engine-arg dynamic_quantization=on: the default)"}
        return {"effective": {"INFERENCE_PRECISION_HINT": PRECISIONS[self.dtype], "base_quant": self.base_quant,
                              **self._plugin_props}, "differs_from_engine_default": differs}

    def version(self) -> str:
        import openvino

        return f"openvino-genai {self._genai.__version__}, openvino {openvino.__version__}, device {self.ov_device}"


def _ir_cache(model_dir: Path) -> Path:
    """Beside the lora cache's models (``<cache>/models/<name>`` -> ``<cache>/openvino``), else the user cache."""
    from lora_conformance.settings import default_cache_dir

    model_dir = Path(model_dir).resolve()
    if model_dir.parent.name == "models":
        return model_dir.parent.parent / "openvino"
    return default_cache_dir() / "openvino"


def _matmul_names(core, xml: Path) -> list[str]:
    model = core.read_model(str(xml))
    return [op.get_friendly_name() for op in model.get_ops() if op.get_type_name() == "MatMul"]
