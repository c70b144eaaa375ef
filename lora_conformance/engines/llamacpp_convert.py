"""Our converters to llama.cpp's GGUF: HF checkpoints (llama, qwen2) and PEFT LoRA adapters.

Written from the GGUF format and llama.cpp's loader, not from llama.cpp's conversion scripts.
Conversion is where LoRA semantics are most easily lost, so what each step does is stated here:

* **Rotary layout.** HF llama rotates the two halves of each head (``rotate_half``); llama.cpp's
  ``llama`` architecture rotates adjacent pairs. The rows of ``q_proj`` / ``k_proj`` are
  interleaved per head so that pair rotation of the new rows equals half rotation of the old;
  a q/k LoRA's ``B`` (its output rows) is interleaved the same way. Qwen2 in llama.cpp rotates
  halves, so nothing is moved there.
* **Tied embeddings** (Qwen2's ``tie_word_embeddings``) are written as an ``output.weight`` copy
  of the token embedding: the same model, and an ``lm_head`` LoRA applies to the output
  projection only, as PEFT applies it (with no ``output`` tensor llama.cpp has nothing to attach
  it to and refuses the adapter).
* **LoRA factors.** GGUF LoRA stores ``<tensor>.lora_a`` (r x in) and ``<tensor>.lora_b``
  (out x r) beside the base tensor's name. The token embedding's LoRA is used the other way
  round: llama.cpp gathers the tokens' rows of ``lora_a`` and multiplies them by ``lora_b``, so
  ``lora_a`` is ``lora_embedding_A``^T (vocab x r) and ``lora_b`` is ``lora_embedding_B`` (hidden x r).
* **Scaling.** llama.cpp scales every LoRA tensor by ``adapter.lora.alpha / r`` with the tensor's
  own rank ``r`` (so ``rank_pattern`` is kept as is). GGUF has one alpha per adapter, so where
  PEFT's per-module scaling differs from ``lora_alpha / r`` — rsLoRA (``alpha / sqrt(r)``) and
  ``alpha_pattern`` — the ratio is folded into that module's ``lora_b`` (float32).
* **MoE (Mixtral).** llama.cpp's ``llama`` architecture with ``expert_count`` serves it
  (``src/models/llama.cpp``: ``ffn_gate_inp``, ``ffn_gate_exps``, ``ffn_up_exps``,
  ``ffn_down_exps``; softmax routing, top-k renormalised, as HF Mixtral). HF's fused
  ``mlp.experts.gate_up_proj`` (E, 2I, H) is split into gate (the first I rows) and up. Expert
  LoRA (PEFT ``target_parameters``, a ``ParamWrapper``: ``lora_A`` (r*E, in) grouped by expert,
  ``lora_B`` (out, r*E) with column ``j*E + e`` for expert e's rank j) is written per expert as
  3-D ``lora_a`` (E, r, in) and ``lora_b`` (E, out, r), which llama.cpp applies with
  ``ggml_mul_mat_id`` on the routed experts (``src/llama-graph.cpp`` ``build_lora_mm_id``); a
  ``gate_up_proj`` LoRA becomes one LoRA on gate (its B's first I rows) and one on up (the rest),
  both with the same A. Which fused parameter a (nested) wrapper's tensors belong to is read
  from their shapes, as PEFT's nesting order is not in the saved config.
* **Encoders (BERT).** llama.cpp's ``bert`` architecture (``src/models/bert.cpp``: q/k/v with
  biases, post-norm, GELU, the server's pooling) with our HF BERT tensor names mapped; the
  pooling (``pooling.json``: mean) goes in ``bert.pooling_type``. LoRA on q/k/v, the attention
  output and the MLP maps to the same GGUF tensors (llama.cpp applies LoRA in ``build_qkv`` and
  ``build_ffn`` through ``build_lora_mm``).
* **What GGUF LoRA cannot hold** is refused with the reason: DoRA magnitudes, LoRA biases and
  ``modules_to_save`` copies.
* **Malformed adapters** never reach a GGUF file: llama.cpp only ever sees what this converter
  writes, so the converter checks the PEFT directory with the shared validator first (names,
  shapes against the base model, ranks, values finite in the engine's dtype, PEFT's target rules)
  and refuses with the file and field; writing NaN or a truncated tensor into GGUF would be a
  conversion bug of ours, not llama.cpp's behaviour.

Files are cached by the sha256 of their inputs, written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Mapping

from lora_conformance import checkpoints
from lora_conformance.engines.base import AdapterFormatError, UnsupportedFeatureError

# Converted files are keyed by their inputs and by this converter's own source: a change to how
# anything is converted never reuses a file converted the old way.
CONVERTER_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
ARCHES = {"llama": "llama", "qwen2": "qwen2", "mixtral": "llama", "bert": "bert"}  # HF model_type -> GGUF arch
# HF module path (below ``model.layers.N.``) -> GGUF tensor name (below ``blk.N.``).
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
MOE_TENSORS = {"mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}  # below ``model.layers.N.``; the fused experts apart
# HF BERT (BertModel, no "bert." prefix) -> GGUF bert names.
BERT_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
            "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}
BERT_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
              "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
              "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
POOLING = {"mean": 1, "cls": 2, "last": 3}  # gguf.PoolingType values; llama-server --pooling names
WEIGHT_TYPES = ("float32", "float16", "bfloat16")


def arch_of(config: Mapping) -> str:
    arch = ARCHES.get(str(config.get("model_type")))
    if arch is None:
        raise UnsupportedFeatureError(
            f"engine 'llamacpp': our GGUF converter handles model_type {', '.join(ARCHES)}, "
            f"not {config.get('model_type')!r}")
    return arch


def gguf_module_name(module: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'blk.3.attn_q' (and BERT's 'encoder.layer.3.attention.self.query'
    -> 'blk.3.attn_q'); raises KeyError for other modules."""
    if module.startswith("bert."):
        module = module[len("bert."):]
    if module in TOP_TENSORS:
        return TOP_TENSORS[module]
    if module in BERT_TOP:
        return BERT_TOP[module]
    parts = module.split(".")
    if len(parts) >= 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        rest = ".".join(parts[3:])
        return f"blk.{parts[2]}.{LAYER_TENSORS.get(rest) or MOE_TENSORS[rest]}"
    if len(parts) >= 4 and parts[0] == "encoder" and parts[1] == "layer" and parts[2].isdigit():
        return f"blk.{parts[2]}.{BERT_LAYER['.'.join(parts[3:])]}"
    raise KeyError(module)


def encoder_pooling(model_dir: Path) -> str:
    """The pooling of an encoder checkpoint (its ``pooling.json``; mean where it has none)."""
    f = Path(model_dir) / "pooling.json"
    pooling = json.loads(f.read_text()).get("pooling", "mean") if f.is_file() else "mean"
    if pooling not in POOLING:
        raise UnsupportedFeatureError(f"engine 'llamacpp': {f}: pooling {pooling!r} (llama.cpp pools "
                                      f"{', '.join(POOLING)})")
    return pooling


def expert_tensors(layer: str, tensors: Mapping[str, object], n_experts: int) -> list[tuple[str, object]]:
    """One layer's HF expert tensors -> GGUF's stacked expert tensors ffn_gate_exps / ffn_up_exps
    (E, I, H) and ffn_down_exps (E, H, I). Saved either fused (transformers 5's in-memory
    ``mlp.experts.gate_up_proj`` (E, 2I, H), gate first, and ``down_proj`` (E, H, I)) or per expert
    (the Mixtral checkpoint format ``block_sparse_moe.experts.<e>.w1`` gate, ``w3`` up, ``w2`` down)."""
    import numpy as np

    p = f"model.layers.{layer}."
    fused = tensors.get(p + "mlp.experts.gate_up_proj")
    if fused is not None:
        half = fused.shape[1] // 2
        gate, up, down = fused[:, :half], fused[:, half:], tensors[p + "mlp.experts.down_proj"]
    else:
        def stack(w):
            try:
                return np.stack([tensors[f"{p}block_sparse_moe.experts.{e}.{w}.weight"] for e in range(n_experts)])
            except KeyError as exc:
                raise UnsupportedFeatureError(f"engine 'llamacpp': expert tensor {exc} missing ({n_experts} experts "
                                              "in config.json)") from None
        gate, up, down = stack("w1"), stack("w3"), stack("w2")
    return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up),
            (f"blk.{layer}.ffn_down_exps.weight", down)]


def interleave_heads(w, n_head: int):
    """Rows of each head reordered from (first half, second half) to adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads_to_interleave(config: Mapping, arch: str, gguf_name: str) -> int | None:
    if arch != "llama":
        return None
    if gguf_name.endswith("attn_q"):
        return int(config["num_attention_heads"])
    if gguf_name.endswith("attn_k"):
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


def _digest(paths: Iterable[Path], extra: str) -> str:
    h = hashlib.sha256(f"{CONVERTER_VERSION}\0{extra}".encode())
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _atomic_write(final: Path, write) -> Path:
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _add(writer, name: str, array, weight_type: str) -> None:
    """A float32 numpy array as ``weight_type``; 1-D tensors (norms, biases) stay float32."""
    import gguf
    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or weight_type == "float32":
        writer.add_tensor(name, array)
    elif weight_type == "float16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)


def _load_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            tensors[k] = v.float().numpy()
    return tensors


def _vocab(model_dir: Path, size: int) -> tuple[list[str], list[int]]:
    """Token strings by id and their GGUF token types (1 normal, 3 control, 5 unused)."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    by_id: dict[int, str] = {int(i): t for t, i in (tok.get("model", {}).get("vocab") or {}).items()}
    special = set()
    for added in tok.get("added_tokens") or ():
        by_id[int(added["id"])] = added["content"]
        if added.get("special"):
            special.add(int(added["id"]))
    tokens, types = [], []
    for i in range(size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(3 if i in special else 1)
        else:
            tokens.append(f"<unused{i}>")
            types.append(5)
    return tokens, types


class QuantizedBase:
    """A quantised checkpoint's GGUF blocks (models/quant.py: q8_0, q4_k), written as they are
    stored, so llama.cpp holds exactly the blocks the reference's weights dequantise from. A float
    checkpoint has none; another scheme is the engine's refusal (``Engine.check_base_quant``)."""

    GGML = {"q8_0": "Q8_0", "q4_k": "Q4_K"}
    FILE_TYPES = {"q8_0": "MOSTLY_Q8_0", "q4_k": "MOSTLY_Q4_K_M"}

    def __init__(self, scheme: str, blocks: Mapping, inputs: list):
        self.scheme, self.blocks, self.inputs = scheme, blocks, inputs

    @classmethod
    def of(cls, model_dir: Path) -> "QuantizedBase":
        from lora_conformance.models import quant

        scheme = quant.scheme_of(model_dir)
        if scheme == "none":
            return cls(scheme, {}, [])
        if scheme not in cls.GGML:
            raise UnsupportedFeatureError(f"engine 'llamacpp': our converter writes GGUF blocks for "
                                          f"{', '.join(cls.GGML)}, not {scheme!r}")
        blocks = {name: t["blocks"] for name, t in quant.load_quantized(model_dir).items()}
        return cls(scheme, blocks, [model_dir / quant.MANIFEST, model_dir / quant.QUANTIZED_FILE])

    @property
    def suffix(self) -> str:
        return "" if self.scheme == "none" else f"-{self.scheme}"

    def file_type(self):
        import gguf

        return getattr(gguf.LlamaFileType, self.FILE_TYPES[self.scheme]) if self.blocks else None

    def add(self, writer, name: str, blocks) -> None:
        import gguf
        import numpy as np

        writer.add_tensor(name, np.ascontiguousarray(blocks),
                          raw_dtype=getattr(gguf.GGMLQuantizationType, self.GGML[self.scheme]))


def convert_model(model_dir: Path, cache_dir: Path, weight_type: str) -> Path:
    """``model_dir`` (an HF llama / qwen2 checkpoint) as a GGUF file with weights in ``weight_type``."""
    import gguf

    if weight_type not in WEIGHT_TYPES:
        raise UnsupportedFeatureError(f"engine 'llamacpp': dtype {weight_type!r} (expected {', '.join(WEIGHT_TYPES)})")
    model_dir = Path(model_dir)
    config = checkpoints.read_model_config(model_dir)
    arch = arch_of(config)
    inputs = [model_dir / "config.json", model_dir / "tokenizer.json", *sorted(model_dir.glob("*.safetensors"))]
    quantized = QuantizedBase.of(model_dir)
    inputs += quantized.inputs
    final = Path(cache_dir) / f"{model_dir.name}-{_digest(inputs, weight_type)}-{weight_type}{quantized.suffix}.gguf"

    if arch == "bert":
        return _atomic_write(final, lambda tmp: _write_bert(tmp, model_dir, config, weight_type))

    def write(tmp: Path) -> None:
        n_head = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // n_head)
        rope = config.get("rope_parameters") or {}
        if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
            raise UnsupportedFeatureError("engine 'llamacpp': our converter writes default rotary embeddings only")
        vocab_size = int(config["vocab_size"])
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(model_dir.name)
        w.add_file_type(quantized.file_type() or {"float32": gguf.LlamaFileType.ALL_F32,
                                                  "float16": gguf.LlamaFileType.MOSTLY_F16,
                                                  "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[weight_type])
        w.add_context_length(int(config.get("max_position_embeddings", 2048)))
        w.add_embedding_length(hidden)
        w.add_block_count(int(config["num_hidden_layers"]))
        w.add_feed_forward_length(int(config["intermediate_size"]))
        experts = int(config.get("num_local_experts") or 0)
        if experts:
            w.add_expert_count(experts)
            w.add_expert_used_count(int(config["num_experts_per_tok"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        w.add_vocab_size(vocab_size)
        tokens, types = _vocab(model_dir, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * vocab_size)
        w.add_token_types(types)
        for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                         ("pad_token_id", w.add_pad_token_id)):
            if isinstance(config.get(key), int):
                add(int(config[key]))
        w.add_add_bos_token(False)  # the plugin passes token ids from our tokenizer
        w.add_add_eos_token(False)
        experts: dict[str, dict] = {}  # layer -> its expert tensors
        tensors = _load_tensors(model_dir)
        if config.get("tie_word_embeddings"):
            # Written as its own output.weight (a copy of the embedding): the same base model, and an
            # lm_head LoRA then applies to the output projection only, as PEFT applies it. Without it
            # llama.cpp computes the output with token_embd, which an adapter's "output" tensor
            # cannot reach (src/llama-adapter.cpp refuses a LoRA tensor for a missing model tensor).
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        for name, array in tensors.items():
            if ".mlp.experts." in name or ".block_sparse_moe.experts." in name:
                experts.setdefault(name.split(".")[2], {})[name] = array
                continue
            module, _, kind = name.rpartition(".")
            try:
                target = gguf_module_name(module)
            except KeyError:
                raise UnsupportedFeatureError(f"engine 'llamacpp': our converter has no GGUF name for {name}") from None
            heads = _heads_to_interleave(config, arch, target)
            if name in quantized.blocks:  # the stored blocks, as they are: rows move with their blocks
                array = quantized.blocks[name]
            if heads is not None:
                array = interleave_heads(array, heads)
            if name in quantized.blocks:
                quantized.add(w, f"{target}.{kind}", array)
            else:
                _add(w, f"{target}.{kind}", array, weight_type)
        n_experts = int(config.get("num_local_experts") or 0)
        for layer, tensors in sorted(experts.items(), key=lambda kv: int(kv[0])):
            for gname, stacked in expert_tensors(layer, tensors, n_experts):
                _add(w, gname, stacked, weight_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _atomic_write(final, write)


def _write_bert(tmp: Path, model_dir: Path, config: Mapping, weight_type: str) -> None:
    """An HF BERT encoder as llama.cpp's ``bert`` architecture (non-causal, pooled)."""
    import gguf

    if (config.get("position_embedding_type") or "absolute") != "absolute":
        raise UnsupportedFeatureError("engine 'llamacpp': llama.cpp's bert takes absolute position embeddings only")
    if (config.get("hidden_act") or "gelu") != "gelu":
        raise UnsupportedFeatureError(f"engine 'llamacpp': llama.cpp's bert computes GELU, not "
                                      f"{config.get('hidden_act')!r}")
    vocab_size = int(config["vocab_size"])
    n_head = int(config["num_attention_heads"])
    w = gguf.GGUFWriter(str(tmp), "bert")
    w.add_name(model_dir.name)
    w.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                     "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[weight_type])
    w.add_context_length(int(config.get("max_position_embeddings", 512)))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(POOLING[encoder_pooling(model_dir)]))
    w.add_vocab_size(vocab_size)
    tokens, types = _vocab(model_dir, vocab_size)
    w.add_tokenizer_model("llama")  # the plugin passes token ids from our tokenizer
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types(types)
    w.add_token_type_count(int(config.get("type_vocab_size", 2)))
    if isinstance(config.get("pad_token_id"), int):
        w.add_pad_token_id(int(config["pad_token_id"]))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for name, array in _load_tensors(model_dir).items():
        module, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias") or module.startswith("pooler."):
            continue  # buffers (position_ids), and BertPooler: embeddings pool last_hidden_state, not it
        try:
            target = gguf_module_name(module)
        except KeyError:
            raise UnsupportedFeatureError(f"engine 'llamacpp': our converter has no GGUF name for {name}") from None
        # token_types stays F32: bert.cpp adds a row of it to the F32 embeddings with ggml_add, which
        # the CPU backend refuses for a BF16 operand (ggml-cpu/binary-ops.cpp: "unsupported types").
        _add(w, f"{target}.{kind}", array, "float32" if target == "token_types" else weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _expert_factors(module: str, a, b, config: Mapping, weights: Path):
    """A (nested) ParamWrapper's lora_A (r*E, in) and lora_B (out, r*E) -> [(GGUF tensor, lora_a
    (E, r, in), lora_b (E, out, r))], the fused parameter chosen by shape (the nesting order of
    PEFT's wrappers is not in the saved config)."""
    import numpy as np

    layer = module.split(".")[2]
    experts = int(config["num_local_experts"])
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    if a.shape[0] % experts or b.shape[1] != a.shape[0]:
        raise AdapterFormatError(weights, module, f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not hold "
                                                  f"{experts} experts' factors")
    r = a.shape[0] // experts
    a3 = np.ascontiguousarray(a.reshape(experts, r, a.shape[1]))
    b3 = np.ascontiguousarray(b.reshape(b.shape[0], r, experts).transpose(2, 0, 1))  # (E, out, r)
    if a.shape[1] == hidden and b.shape[0] == 2 * inter:  # gate_up_proj (E, 2I, H)
        return r, [(f"blk.{layer}.ffn_gate_exps", a3, np.ascontiguousarray(b3[:, :inter])),
                   (f"blk.{layer}.ffn_up_exps", a3, np.ascontiguousarray(b3[:, inter:]))]
    if a.shape[1] == inter and b.shape[0] == hidden:  # down_proj (E, H, I)
        return r, [(f"blk.{layer}.ffn_down_exps", a3, b3)]
    raise AdapterFormatError(weights, module, f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} fit neither "
                                              f"mlp.experts.gate_up_proj nor mlp.experts.down_proj")


def module_scaling(cfg: Mapping, module: str) -> tuple[int, float]:
    """PEFT's (rank, scaling) of ``module`` (``checkpoints.peft_scaling``: rank/alpha patterns, rsLoRA)."""
    return checkpoints.module_rank_alpha(cfg, module)[0], checkpoints.peft_scaling(cfg, module)


def convert_adapter(adapter_dir: Path, model_dir: Path, cache_dir: Path, max_rank: int | None = None,
                    dtype: str = "float32") -> Path:
    """A PEFT LoRA adapter directory as a GGUF LoRA file for the GGUF of ``model_dir``, after the
    shared validator accepted it for an engine computing in ``dtype``."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from lora_conformance.adapters.validate import validate_adapter

    adapter_dir = Path(adapter_dir)
    validate_adapter(adapter_dir, Path(model_dir), max_rank, dtype)
    info = checkpoints.adapter_info(adapter_dir)
    cfg = dict(info.raw)
    cfg_model = checkpoints.read_model_config(model_dir)
    refused = [why for cond, why in (
        (info.use_dora, "use_dora (GGUF LoRA has no DoRA magnitude vector)"),
        (bool(info.modules_to_save), "modules_to_save (GGUF LoRA holds no full module copies)"),
        (info.bias != "none" or info.lora_bias, "LoRA biases (GGUF LoRA holds lora_a / lora_b only)"),
        (bool(info.target_parameters) and str(cfg_model.get("model_type")) != "mixtral",
         "target_parameters on a base without fused experts"),
    ) if cond]
    if refused:
        raise UnsupportedFeatureError(f"engine 'llamacpp': {adapter_dir}: {'; '.join(refused)}")
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterFormatError(weights, "file", "not found (the converter reads adapter_model.safetensors)")
    config = checkpoints.read_model_config(model_dir)
    arch = arch_of(config)
    final = Path(cache_dir) / f"{adapter_dir.name}-{_digest([adapter_dir / checkpoints.ADAPTER_CONFIG, weights], arch)}.gguf"

    def write(tmp: Path) -> None:
        factors: dict[str, dict[str, object]] = {}
        for key, value in load_file(str(weights)).items():
            k = checkpoints.split_lora_key(key)
            if not k.factor and key.endswith(".base_layer.weight"):
                continue  # PEFT's copy of a targeted embedding / lm_head base matrix, not LoRA
            if not k.factor or (k.depth and ".mlp.experts" not in key):
                raise UnsupportedFeatureError(f"engine 'llamacpp': {weights}: tensor {key} is not a plain LoRA factor")
            entry = factors.setdefault((k.module, k.depth), {})
            entry[k.factor] = value.astype(np.float32)
            entry["embedding"] = k.embedding
        alpha = checkpoints.module_rank_alpha(cfg)[1] or 1.0  # GGUF's one alpha (PEFT's default 8 if unset)
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", alpha)
        for (module, _depth), f in sorted(factors.items()):
            if "A" not in f or "B" not in f:
                raise AdapterFormatError(weights, module, "has only one of lora_A / lora_B")
            if module.endswith(".mlp.experts"):
                r_e, parts = _expert_factors(module, f["A"], f["B"], config, weights)
                r, scaling = module_scaling(cfg, module)
                if r_e != r:
                    raise AdapterFormatError(weights, module, f"rank {r_e} per expert but the config says r={r}")
                ratio = np.float32(scaling / checkpoints.scaling_rule(r, alpha, use_rslora=False))
                for target, a3, b3 in parts:
                    w.add_tensor(f"{target}.weight.lora_a", a3)
                    w.add_tensor(f"{target}.weight.lora_b", np.ascontiguousarray(b3 * ratio))
                continue
            try:
                target = gguf_module_name(module)
            except KeyError:
                raise UnsupportedFeatureError(f"engine 'llamacpp': no GGUF tensor for LoRA target {module}") from None
            a, b = f["A"], f["B"]
            if f["embedding"]:
                # llama.cpp gathers token rows of lora_a and multiplies them by lora_b:
                # lora_a (vocab, r) = lora_embedding_A^T, lora_b (hidden, r) = lora_embedding_B.
                a = a.T
            r, scaling = module_scaling(cfg, module)
            if (a.shape[1] if f["embedding"] else a.shape[0]) != r:
                raise AdapterFormatError(weights, module, f"rank {a.shape[0]} but the config says r={r}")
            b = b * np.float32(scaling / checkpoints.scaling_rule(r, alpha, use_rslora=False))  # llama.cpp: alpha / r
            heads = _heads_to_interleave(config, arch, target)
            if heads is not None:
                b = interleave_heads(b, heads)
            w.add_tensor(f"{target}.weight.lora_a", np.ascontiguousarray(a))
            w.add_tensor(f"{target}.weight.lora_b", np.ascontiguousarray(b))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _atomic_write(final, write)


def torch_threads() -> int:
    """llama.cpp's thread count where none is given: torch's (the run's share of the cores)."""
    import torch

    return max(1, torch.get_num_threads())


def gguf_cache(model_dir: Path) -> Path:
    """Beside the lora cache's models (``<cache>/models/<name>`` -> ``<cache>/gguf``), else the user cache."""
    from lora_conformance.settings import default_cache_dir

    model_dir = Path(model_dir).resolve()
    if model_dir.parent.name == "models":
        return model_dir.parent.parent / "gguf"
    return default_cache_dir() / "gguf"
