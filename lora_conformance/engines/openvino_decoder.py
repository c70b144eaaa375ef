"""A Llama-family decoder forward written to be traced by ``openvino.convert_model``.

Same arithmetic as transformers' Llama / Mistral / Qwen2 / Qwen3 (RMSNorm in float32, default
RoPE with float32 angles, grouped-query attention through ``scaled_dot_product_attention``),
with the KV cache as explicit tensors in and out so that the converter can turn each pair into
OpenVINO state. Module paths are the HF ones, which GenAI's LoRA binding relies on.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _linear(state: dict, prefix: str, bias: bool) -> nn.Linear:
    w = state[f"{prefix}.weight"]
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias:
        lin.bias = nn.Parameter(state[f"{prefix}.bias"], requires_grad=False)
    return lin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict, state: dict, prefix: str):
        super().__init__()
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        qkv_bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
        self.q_proj = _linear(state, f"{prefix}.q_proj", qkv_bias)
        self.k_proj = _linear(state, f"{prefix}.k_proj", qkv_bias)
        self.v_proj = _linear(state, f"{prefix}.v_proj", qkv_bias)
        self.o_proj = _linear(state, f"{prefix}.o_proj", f"{prefix}.o_proj.bias" in state)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(state[f"{prefix}.q_norm.weight"], eps) if f"{prefix}.q_norm.weight" in state else None
        self.k_norm = RMSNorm(state[f"{prefix}.k_norm.weight"], eps) if f"{prefix}.k_norm.weight" in state else None

    def forward(self, x, cos, sin, mask, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        group = self.heads // self.kv_heads
        k_all = k.unsqueeze(2).expand(b, self.kv_heads, group, k.shape[2], self.head_dim).reshape(
            b, self.heads, k.shape[2], self.head_dim)
        v_all = v.unsqueeze(2).expand(b, self.kv_heads, group, v.shape[2], self.head_dim).reshape(
            b, self.heads, v.shape[2], self.head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                                               scale=self.head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, cfg: dict, state: dict, prefix: str):
        super().__init__()
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_proj = _linear(state, f"{prefix}.gate_proj", bias)
        self.up_proj = _linear(state, f"{prefix}.up_proj", bias)
        self.down_proj = _linear(state, f"{prefix}.down_proj", bias)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict, state: dict, prefix: str):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(state[f"{prefix}.input_layernorm.weight"], eps)
        self.self_attn = Attention(cfg, state, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(state[f"{prefix}.post_attention_layernorm.weight"], eps)
        self.mlp = MLP(cfg, state, f"{prefix}.mlp")

    def forward(self, x, cos, sin, mask, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class Backbone(nn.Module):
    def __init__(self, cfg: dict, state: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(state["model.embed_tokens.weight"], freeze=True)
        self.layers = nn.ModuleList(Layer(cfg, state, f"model.layers.{i}") for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(state["model.norm.weight"], cfg.get("rms_norm_eps", 1e-6))


class TracedDecoder(nn.Module):
    """forward(input_ids, attention_mask, position_ids, past) -> (logits, *presents)."""

    def __init__(self, cfg: dict, state: dict):
        super().__init__()
        state = {k: v.float() for k, v in state.items()}
        self.num_layers = cfg["num_hidden_layers"]
        self.model = Backbone(cfg, state)
        attn = self.model.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.kv_heads, attn.head_dim
        head = state.get("lm_head.weight")
        if head is None or cfg.get("tie_word_embeddings"):
            head = state["model.embed_tokens.weight"]
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, attention_mask, position_ids, past):
        x = self.model.embed_tokens(input_ids)
        freqs = position_ids.float()[:, :, None] * self.inv_freq[None, None, :]  # [b, t, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None]
        sin = emb.sin().to(x.dtype)[:, None]
        t = input_ids.shape[1]
        total = attention_mask.shape[1]
        q_pos = torch.arange(t, device=input_ids.device) + (total - t)
        k_pos = torch.arange(total, device=input_ids.device)
        causal = k_pos[None, :] <= q_pos[:, None]
        mask = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()
        presents = []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, mask, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        # No cast after lm_head: a folded no-op cast would give the MatMul its name, and GenAI
        # finds lm_head LoRA by the MatMul's name.
        return (self.lm_head(self.model.norm(x)), *presents)
