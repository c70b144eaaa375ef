"""config.json -> ModelSpec: the handful of numbers our model code needs, per architecture family."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lora_conformance.checkpoints import kind_of_config, read_model_config
from lora_conformance.engines.base import UnsupportedFeatureError

DECODERS = {"llama", "mistral", "qwen2", "qwen3"}
MOE_DECODERS = {"mixtral", "qwen2_moe", "qwen3_moe"}
ENCODERS = {"bert"}


@dataclass
class ModelSpec:
    model_type: str
    kind: str  # "decoder" | "moe" | "encoder"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    # MoE
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_probs_in_fp32: bool = False  # Mixtral keeps routing weights in float32
    shared_expert_intermediate_size: int = 0
    moe_layers: list[int] = field(default_factory=list)
    # encoders
    type_vocab_size: int = 0

    def is_moe_layer(self, i: int) -> bool:
        return self.kind == "moe" and i in self.moe_layers


def _rope(cfg: dict) -> tuple[float, Optional[dict]]:
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def load_spec(model_dir: Path) -> ModelSpec:
    cfg = read_model_config(model_dir)
    mt = cfg.get("model_type", "")
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    served_as = "encoder" if mt in ENCODERS else "moe" if mt in MOE_DECODERS else "decoder"
    if mt in DECODERS | MOE_DECODERS | ENCODERS and kind_of_config(cfg) != served_as:
        raise UnsupportedFeatureError(  # the harness and the reference would load it as the other kind
            f"{model_dir}/config.json describes a {mt} {kind_of_config(cfg)} (architectures "
            f"{cfg.get('architectures')}); the builtin engine serves {mt} only as a {served_as}")
    if mt in ENCODERS:
        h = cfg["hidden_size"]
        return ModelSpec(
            model_type=mt, kind="encoder", vocab_size=cfg["vocab_size"], hidden_size=h,
            num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_attention_heads"], head_dim=h // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=cfg.get("hidden_act", "gelu"), max_position_embeddings=cfg["max_position_embeddings"],
            type_vocab_size=cfg.get("type_vocab_size", 2),
        )
    if mt not in DECODERS | MOE_DECODERS:
        raise UnsupportedFeatureError(
            f"model_type {mt!r} in {model_dir}/config.json is not served by the builtin engine "
            f"(supported: {', '.join(sorted(DECODERS | MOE_DECODERS | ENCODERS))})"
        )
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    spec = ModelSpec(
        model_type=mt, kind="moe" if mt in MOE_DECODERS else "decoder", vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg.get("intermediate_size", 0), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        hidden_act=cfg.get("hidden_act", "silu"), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        qkv_bias=bool(cfg.get("attention_bias", False)) or mt in ("qwen2", "qwen2_moe") and cfg.get("qkv_bias", True),
        o_bias=bool(cfg.get("attention_bias", False)) and mt not in ("qwen2", "qwen2_moe"),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
    )
    if mt == "mixtral":
        spec.num_experts, spec.moe_intermediate_size = cfg["num_local_experts"], cfg["intermediate_size"]
        spec.top_k_experts, spec.norm_topk_prob, spec.router_probs_in_fp32 = cfg["num_experts_per_tok"], True, True
        spec.moe_layers = list(range(spec.num_layers))
    elif mt in ("qwen2_moe", "qwen3_moe"):
        spec.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
        spec.moe_intermediate_size = cfg["moe_intermediate_size"]
        spec.top_k_experts, spec.norm_topk_prob = cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", False))
        spec.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        spec.moe_layers = [i for i in range(spec.num_layers) if i not in only and (i + 1) % step == 0]
    return spec
