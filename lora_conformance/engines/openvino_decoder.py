"""A Llama-family decoder forward written to be traced by ``openvino.convert_model``.

Same arithmetic as transformers' Llama / Mistral / Qwen2 / Qwen3 / Mixtral (RMSNorm in float32, default
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


class Experts(nn.Module):
    """Mixtral's fused experts (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]),
    every expert computed for every token, one 2-D MatMul per expert and projection (slices of the
    3-D parameters, folded to constants by the conversion; a batched MatMul over the 3-D constant
    is mis-compiled by the CPU plugin 2026.4 as a FullyConnected); the routing weights, zero for
    unselected experts, pick the sum."""

    def __init__(self, state: dict, prefix: str):
        super().__init__()
        self.gate_up_proj = nn.Parameter(state[f"{prefix}.gate_up_proj"], requires_grad=False)
        self.down_proj = nn.Parameter(state[f"{prefix}.down_proj"], requires_grad=False)
        self.num_experts = self.gate_up_proj.shape[0]

    def forward(self, x, weights):  # x [N, H], weights [N, E]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out = out + y * weights[:, e:e + 1]
        return out


def fused_experts(state: dict, prefix: str, experts: int) -> None:
    """Mixtral checkpoints on disk hold each expert apart (``block_sparse_moe.experts.N.w1/w3/w2``:
    gate, up, down; transformers 5 converts them when it loads and back when it saves); the traced
    model uses transformers 5's runtime names and layout (``mlp.gate``, ``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), which PEFT's adapters name. In place."""
    old = f"{prefix}.block_sparse_moe"
    if f"{old}.gate.weight" not in state:
        return
    state[f"{prefix}.mlp.gate.weight"] = state.pop(f"{old}.gate.weight")
    w = [{k: state.pop(f"{old}.experts.{e}.{k}.weight") for k in ("w1", "w2", "w3")} for e in range(experts)]
    state[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["w1"], x["w3"]], 0) for x in w])
    state[f"{prefix}.mlp.experts.down_proj"] = torch.stack([x["w2"] for x in w])


class SparseMoE(nn.Module):
    """Mixtral's MoE block: softmax router in float32, top-k experts, their weights renormalised."""

    def __init__(self, cfg: dict, state: dict, prefix: str):
        super().__init__()
        self.top_k = cfg["num_experts_per_tok"]
        self.gate = _linear(state, f"{prefix}.gate", False)
        self.experts = Experts(state, f"{prefix}.experts")

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        kth = torch.topk(probs, self.top_k, dim=-1).values[:, -1:]
        chosen = probs * (probs >= kth).to(probs.dtype)
        weights = (chosen / chosen.sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(flat, weights).reshape(b, t, h)


class Layer(nn.Module):
    def __init__(self, cfg: dict, state: dict, prefix: str):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(state[f"{prefix}.input_layernorm.weight"], eps)
        self.self_attn = Attention(cfg, state, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(state[f"{prefix}.post_attention_layernorm.weight"], eps)
        if cfg.get("num_local_experts"):
            fused_experts(state, prefix, cfg["num_local_experts"])
        moe = f"{prefix}.mlp.experts.gate_up_proj" in state
        self.mlp = SparseMoE(cfg, state, f"{prefix}.mlp") if moe else MLP(cfg, state, f"{prefix}.mlp")

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
