"""Convert an HF decoder checkpoint and its tokenizer to the OpenVINO IR that OpenVINO GenAI loads.

optimum-intel does this for OpenVINO's users, but it pins transformers below what this project
needs, so the plugin converts by itself, offline, and caches the result by the checkpoint's
content hash (``<lora cache>/openvino/<hash>-v<converter version>/``; the plugin's ``ir_cache`` arg moves it).

What GenAI expects of a directory (as optimum-intel writes it): ``openvino_model.xml/.bin``, a
*stateful* model with inputs ``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``
and output ``logits``, whose KV cache lives in ReadValue/Assign state; ``openvino_tokenizer.xml``
and ``openvino_detokenizer.xml`` (openvino_tokenizers' conversion of the HF tokenizer); and
``config.json`` / ``generation_config.json``. GenAI turns the stateful model into a paged-attention
one itself (continuous batching) by matching ScaledDotProductAttention over concatenated state.

The traced forward (``_TracedDecoder``) is a plain Llama-family decoder (Llama, Mistral, Qwen2
and Qwen3 without sliding windows: RMSNorm, default RoPE, GQA, SiLU MLP, optional q/k/v biases
and q/k norms, tied or untied head; Mixtral's MoE block with its fused 3-D experts, which GenAI's
LLM path serves like any other IR: its supported models list Mixtral) written for tracing, built
from the checkpoint's own weights. Module paths keep the HF names (``model.layers.0.self_attn.q_proj``) because GenAI binds
a LoRA tensor to the MatMul whose node name contains the tensor's module path.
A checkpoint outside that family (rope scaling, sliding windows, other architectures) is refused
with ``UnsupportedModelError`` before anything is traced; an encoder is refused because GenAI's
TextEmbeddingPipeline takes no adapters (``GENAI_EMBEDDINGS``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lora_conformance.checkpoints import read_model_config
from lora_conformance.engines.base import UnsupportedFeatureError

IR_FILES = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
# Bump when the traced graph changes: it is part of the cache key.
CONVERTER_VERSION = 3
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
# GenAI serves encoders through TextEmbeddingPipeline, which takes no LoRA adapters at all: its API
# (embed_documents / embed_query) has no adapter argument and src/cpp/src/rag/ has no LoRA code.
GENAI_EMBEDDINGS = ("https://github.com/openvinotoolkit/openvino.genai/blob/da1db864d2bc1a265e9a036f5b57ef13f0e86c2c/"
                    "src/cpp/include/openvino/genai/rag/text_embedding_pipeline.hpp#L162-L192")
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "nomic_bert", "mpnet")


class UnsupportedModelError(UnsupportedFeatureError):
    """The checkpoint is not one this converter (hence this plugin) can serve."""


def check_convertible(model_dir: Path) -> dict:
    """config.json of a checkpoint the tracer handles, or UnsupportedModelError saying why not."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = read_model_config(model_dir)
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"openvino engine: cannot read {path}: {exc}") from exc
    kind = cfg.get("model_type")
    if kind in ENCODER_TYPES:
        raise UnsupportedModelError(
            f"openvino engine: {path}: model_type {kind!r} is an encoder; OpenVINO GenAI serves encoders with "
            f"TextEmbeddingPipeline, which takes no LoRA adapters (no adapter argument, no LoRA code: "
            f"{GENAI_EMBEDDINGS})")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"openvino engine: {path}: model_type {kind!r} is not converted by this plugin "
            f"(expected one of {', '.join(SUPPORTED_MODEL_TYPES)})")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UnsupportedModelError(f"openvino engine: {path}: rope_type {rope.get('rope_type')!r} is not converted "
                                    "(only default RoPE)")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", kind == "mistral"):
        raise UnsupportedModelError(f"openvino engine: {path}: sliding-window attention is not converted")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"openvino engine: {path}: hidden_act {cfg.get('hidden_act')!r} (expected silu)")
    return cfg


def converted_model(model_dir: Path, cache_root: Path) -> Path:
    """The IR directory for ``model_dir`` (converted once per content hash)."""
    from lora_conformance.fileio import build_directory_once
    from lora_conformance.models import content_hash

    from lora_conformance.models.quant import scheme_of

    check_convertible(model_dir)
    scheme = scheme_of(model_dir)
    key = f"{content_hash(model_dir)[:16]}-v{CONVERTER_VERSION}" + ("" if scheme == "none" else f"-{scheme}")
    return build_directory_once(Path(cache_root) / key, lambda d: all((d / f).is_file() for f in IR_FILES),
                                lambda tmp: convert(Path(model_dir), tmp))


def convert(model_dir: Path, out: Path) -> None:
    """Write the IR for ``model_dir`` into ``out`` (no caching). Weights are stored in float32;
    the device computes in the precision the engine asks for (``INFERENCE_PRECISION_HINT``)."""
    import openvino as ov

    cfg = check_convertible(model_dir)
    model = _trace(model_dir, cfg)
    compress_weights(model, model_dir)
    ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False)
    _convert_tokenizer(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    if not (out / "generation_config.json").is_file():
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}))


QUANTIZED_SCHEMES = ("ov_int8", "ov_int4")


def compress_weights(ov_model, model_dir: Path) -> int:
    """A quantised checkpoint (models/quant.py: ov_int8, ov_int4): each quantised weight's float
    Constant replaced by OpenVINO's weight-compression subgraph over the *stored* codes, as NNCF
    writes it: Constant(u8 | u4) -> Convert(f32) -> Subtract(zero point) -> Multiply(scale)
    [-> Reshape, int4 groups] -> the MatMul. The plugin keeps such subgraphs compressed (its
    MarkDequantization), so the device holds the codes; the scale is the stored float16 value
    as f32, so (q - zp) * scale is exact in f32 and equals the reference's dequantised weight.
    Returns how many weights were compressed (0 for a float checkpoint)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from lora_conformance.models import quant

    scheme = quant.scheme_of(model_dir)
    if scheme == "none":
        return 0
    if scheme not in QUANTIZED_SCHEMES:
        raise UnsupportedModelError(f"openvino engine: {model_dir}: base quantisation {scheme!r} (the converter "
                                    f"writes {', '.join(QUANTIZED_SCHEMES)})")
    stored = quant.load_quantized(model_dir)
    constants = {op.get_friendly_name(): op for op in ov_model.get_ops() if op.get_type_name() == "Constant"}
    done = 0
    for name, t in stored.items():
        const = constants.get(f"self.{name}")
        if const is None:
            raise UnsupportedModelError(f"openvino engine: no weight constant for {name} in the traced model")
        out_f, in_f = (int(d) for d in const.get_output_shape(0))
        if scheme == "ov_int8":
            q = ops.constant(t["qweight"], dtype=ov.Type.u8)
            zp, scale = t["zero_point"], t["scale"]
        else:
            groups = in_f // quant.INT4_GROUP
            q = ops.constant(t["qweight"].reshape(out_f, groups, quant.INT4_GROUP), dtype=ov.Type.u4)
            zp, scale = t["zero_point"].reshape(out_f, groups, 1), t["scale"].reshape(out_f, groups, 1)
        zp_c = ops.convert(ops.constant(zp, dtype=ov.Type.u8 if scheme == "ov_int8" else ov.Type.u4), "f32")
        w = ops.multiply(ops.subtract(ops.convert(q, "f32"), zp_c),
                         ops.constant(scale.astype(np.float32), dtype=ov.Type.f32))
        if scheme == "ov_int4":
            w = ops.reshape(w, ops.constant(np.array([out_f, in_f], dtype=np.int64)), special_zero=False)
        for target in list(const.output(0).get_target_inputs()):
            target.replace_source_output(w.output(0))
        done += 1
    ov_model.validate_nodes_and_infer_types()
    return done


def _convert_tokenizer(model_dir: Path, out: Path) -> None:
    import openvino as ov
    import openvino_tokenizers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    tok, detok = openvino_tokenizers.convert_tokenizer(hf, with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(out / "openvino_detokenizer.xml"))


def _trace(model_dir: Path, cfg: dict):
    """The stateful ov.Model of the checkpoint."""
    import openvino as ov
    import torch
    from openvino._offline_transformations import apply_make_stateful_transformation
    from safetensors.torch import load_file

    from lora_conformance.engines.openvino_decoder import TracedDecoder

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise UnsupportedModelError(f"openvino engine: {model_dir} has no .safetensors weights")
    module = TracedDecoder(cfg, state).eval()

    layers = module.num_layers
    kv_shape = (1, module.kv_heads, 2, module.head_dim)
    example = {
        "input_ids": torch.ones((1, 3), dtype=torch.long),
        "attention_mask": torch.ones((1, 5), dtype=torch.long),
        "position_ids": torch.arange(2, 5).unsqueeze(0),
        "past": tuple(torch.zeros(kv_shape, dtype=torch.float32) for _ in range(2 * layers)),
    }
    with torch.no_grad():
        ov_model = ov.convert_model(module, example_input=example)

    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    for port, name in zip(ov_model.inputs, ["input_ids", "attention_mask", "position_ids", *past_names]):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, ["logits", *present_names]):
        port.get_tensor().set_names({name})
    dyn = ov.PartialShape([-1, module.kv_heads, -1, module.head_dim])
    for port in ov_model.inputs[3:]:
        port.get_node().set_partial_shape(dyn)
    for port in ov_model.inputs[:3]:
        port.get_node().set_partial_shape(ov.PartialShape([-1, -1]))
    ov_model.validate_nodes_and_infer_types()
    _add_beam_idx(ov_model, past_names)
    apply_make_stateful_transformation(ov_model, dict(zip(past_names, present_names)))
    _zero_state_of_batch_size(ov_model, module.kv_heads, module.head_dim)
    return ov_model


def _zero_state_of_batch_size(ov_model, kv_heads: int, head_dim: int) -> None:
    """Give each cache ReadValue an initial value, zeros of shape [batch, kv_heads, 0, head_dim]
    with the batch of ``input_ids``: the stateful pipeline needs it for a batch of several
    prompts, and GenAI's paged-attention rewrite only matches ReadValue nodes that have one."""
    import numpy as np
    import openvino.opset13 as ops

    batch = ops.gather(ops.shape_of(ov_model.input("input_ids"), output_type="i64"),
                       ops.constant(np.array([0], dtype=np.int64)), ops.constant(0))
    rest = ops.constant(np.array([kv_heads, 0, head_dim], dtype=np.int64))
    shape = ops.concat([batch, rest], axis=0)
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            zero = ops.constant(np.array(0.0, dtype=np.float32))
            op.set_arguments([ops.broadcast(zero, shape).output(0)])
    ov_model.validate_nodes_and_infer_types()


def _add_beam_idx(ov_model, past_names: list[str]) -> None:
    """GenAI feeds ``beam_idx`` (which cache row each sequence continues); the cache inputs are
    gathered by it, as optimum-intel's exported models do."""
    import openvino as ov
    import openvino.opset13 as ops

    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    axis = ops.constant(0, ov.Type.i64)
    for inp in ov_model.inputs:
        if inp.get_any_name() in past_names:
            param = inp.get_node()
            consumers = list(param.output(0).get_target_inputs())
            gathered = ops.gather(param, beam_idx, axis)
            for c in consumers:
                c.replace_source_output(gathered.output(0))
    ov_model.validate_nodes_and_infer_types()
