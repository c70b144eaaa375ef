"""Build our model for a checkpoint directory and fill it from its safetensors files.

Checkpoint names are normalised onto our module tree: Mixtral's ``block_sparse_moe`` and
per-expert ``w1/w3/w2`` (and Qwen-MoE's per-expert ``gate_proj/up_proj/down_proj``) are
fused into the 3-D ``gate_up_proj`` / ``down_proj`` layout that transformers 5 uses;
already-fused checkpoints load as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from lora_conformance import devices
from lora_conformance.engines.base import EngineFailure
from lora_conformance.engines.builtin.layers.linear import fuse_linear_groups
from lora_conformance.engines.builtin.models.config import ModelSpec

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineFailure(f"no *.safetensors weights in {model_dir} (the builtin engine reads safetensors only)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def normalise_decoder_names(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for k, t in raw.items():
        k = k.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(_PART[m.group(3)], {})[int(m.group(2))] = t
            continue
        if k.endswith(".mlp.experts.gate_up_proj") or k.endswith(".mlp.experts.down_proj"):
            k += ".weight"
        out[k] = t
    for prefix, parts in experts.items():
        n = len(parts["gate"])
        out[prefix + ".gate_up_proj.weight"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]], dim=0) for e in range(n)]
        )
        out[prefix + ".down_proj.weight"] = torch.stack([parts["down"][e] for e in range(n)])
    return out


def normalise_encoder_names(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in raw.items():
        k = k[len("bert."):] if k.startswith("bert.") else k
        if k.startswith("cls.") or k.endswith("position_ids"):
            continue
        k = k.replace(".gamma", ".weight").replace(".beta", ".bias")
        out[k] = t
    return out


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], spec: ModelSpec, dtype) -> None:
    params = dict(model.named_parameters())
    missing = []
    for name, p in params.items():
        t = tensors.get(name)
        if t is None and name == "lm_head.weight" and spec.tie_word_embeddings:
            t = tensors.get("model.embed_tokens.weight")
        if t is None:
            missing.append(name)
            continue
        t = _shard_of(model, name, t)
        if tuple(t.shape) != tuple(p.shape):
            raise EngineFailure(f"checkpoint tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        p.data = t.to(device=p.device, dtype=dtype).contiguous()
    if spec.kind != "encoder" and "lm_head.weight" in missing and "model.embed_tokens.weight" in tensors:
        missing.remove("lm_head.weight")  # tied without saying so in config.json
        model.lm_head.weight.data = model.model.embed_tokens.weight.data
    if spec.kind == "encoder":  # the pooler is unused (we pool tokens) and optional in checkpoints
        missing = [m for m in missing if not m.startswith("pooler.")]
    if missing:
        raise EngineFailure(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")


def _shard_of(model: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``name`` (the whole tensor where its module is not
    sharded): column shards slice output rows (and their biases), row shards input columns (the
    bias is added once, after the reduction: whole), vocab shards embedding rows."""
    owner, _, leaf = name.rpartition(".")
    shard = getattr(model.get_submodule(owner), "shard", None) if owner else None
    if shard is None:
        return t
    if shard.kind in ("column", "vocab"):
        return t[shard.start: shard.end]
    return t[:, shard.start: shard.end] if leaf == "weight" else t


def pooling_mode(model_dir: Path) -> str:
    """sentence-transformers writes the pooling choice in 1_Pooling/config.json; default mean."""
    for cand in sorted(Path(model_dir).glob("*Pooling*/config.json")):
        cfg = json.loads(cand.read_text())
        if cfg.get("pooling_mode_cls_token"):
            return "cls"
        if cfg.get("pooling_mode_mean_tokens"):
            return "mean"
    return "mean"


def build_model(model_dir: Path, spec: ModelSpec, max_len: int, device: str, dtype, rope_exponent_dim: int = 0,
                tp=None, quant=None):
    """rope_exponent_dim: the dimension in rotary theta's exponent (0: the head dim; another only
    under fault rotary_assumes_head_dim_64, decided in engine/plan.py). tp: this rank's
    TensorParallel (layers/parallel.py), None on one device: each rank loads the whole checkpoint
    and keeps its shard. quant: layers/int8_linear.QuantRules for an int8 base (None: correct)."""
    raw = read_safetensors(model_dir)
    if spec.kind == "encoder":
        from lora_conformance.engines.builtin.models.bert import Encoder

        model = Encoder(spec, pooling_mode(model_dir))
        tensors = normalise_encoder_names(raw)
    else:
        from lora_conformance.engines.builtin.models.llama import CausalLM

        model = CausalLM(spec, max_len, device, dtype, rope_exponent_dim, tp)
        tensors = normalise_decoder_names(raw)
    model.to(device)
    load_weights(model, tensors, spec, dtype)
    from lora_conformance.engines.builtin.layers import int8_linear

    rules = quant or int8_linear.QuantRules()
    int8_linear.attach(model, model_dir, rules, dtype, tp)  # an int8 base: its codes
    from lora_conformance.engines.builtin.layers import gguf_base

    # a GGUF base: its blocks decoded; with activations=int8 read through 8-bit activation blocks
    gguf_base.attach(model, model_dir, rules)
    # q/k/v and gate/up: one weight each, the modules' weights views of it; (in, out) storage on cpu
    fuse_linear_groups(model, transposed=devices.device_type(device) == "cpu")
    model.eval()
    return model
