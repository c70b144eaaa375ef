"""BERT-style encoder for embeddings: padded batch, key-padding mask, pooled and L2-normalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers.linear import LoraContext, LoraLinear
from lora_conformance.engines.builtin.layers.lora import LoraBatch
from lora_conformance.engines.builtin.models.config import ModelSpec
from lora_conformance.engines.builtin.models.llama import ACTIVATIONS


class _Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(spec.type_vocab_size, 1), spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.word_embeddings(ids) + self.token_type_embeddings(torch.zeros_like(ids)) + self.position_embeddings(pos)
        return self.LayerNorm(x)


class _Dense(nn.Module):
    """``<x>.dense`` + optional LayerNorm, the naming HF BERT checkpoints use."""

    def __init__(self, n_in, n_out, ctx, eps=None):
        super().__init__()
        self.dense = LoraLinear(n_in, n_out, True, ctx)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(n_out, eps=eps)


class _SelfAttention(nn.Module):
    def __init__(self, spec, ctx):
        super().__init__()
        h = spec.hidden_size
        self.query, self.key, self.value = (LoraLinear(h, h, True, ctx) for _ in range(3))


class _Attention(nn.Module):
    def __init__(self, spec, ctx):
        super().__init__()
        self.self = _SelfAttention(spec, ctx)
        self.output = _Dense(spec.hidden_size, spec.hidden_size, ctx, spec.norm_eps)


class _Layer(nn.Module):
    def __init__(self, spec: ModelSpec, ctx):
        super().__init__()
        self.attention = _Attention(spec, ctx)
        self.intermediate = _Dense(spec.hidden_size, spec.intermediate_size, ctx)
        self.output = _Dense(spec.intermediate_size, spec.hidden_size, ctx, spec.norm_eps)
        self.heads, self.act = spec.num_heads, ACTIVATIONS[spec.hidden_act]

    def forward(self, x, key_mask):
        B, L, H = x.shape
        sa = self.attention.self
        split = lambda t: t.view(B, L, self.heads, -1).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(sa.query(x)), split(sa.key(x)), split(sa.value(x)), attn_mask=key_mask)
        a = a.transpose(1, 2).reshape(B, L, H)
        out = self.attention.output
        x = out.LayerNorm(out.dense(a) + x)
        h = self.act(self.intermediate.dense(x))
        return self.output.LayerNorm(self.output.dense(h) + x)


class _Encoder(nn.Module):
    def __init__(self, spec, ctx):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(spec, ctx) for _ in range(spec.num_layers))


class Encoder(nn.Module):
    def __init__(self, spec: ModelSpec, pooling: str = "mean"):
        super().__init__()
        self.spec, self.pooling = spec, pooling
        self.lora_ctx = LoraContext()
        self.embeddings = _Embeddings(spec)
        self.encoder = _Encoder(spec, self.lora_ctx)
        # Kept so that adapters targeting "dense" (which PEFT also applies to the pooler) load;
        # token pooling never reads it.
        self.pooler = _Dense(spec.hidden_size, spec.hidden_size, self.lora_ctx)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """ids/attn (B, L) -> normalised pooled embeddings (B, H) in float32."""
        B, L = ids.shape
        self.lora_ctx.batch = lora
        try:
            x = self.embeddings(ids)
            key_mask = attn.bool().view(B, 1, 1, L)
            x2 = x.reshape(B, L, -1)
            for layer in self.encoder.layer:
                x2 = layer(x2, key_mask)
        finally:
            self.lora_ctx.batch = None
        if self.pooling == "cls":
            pooled = x2[:, 0].float()
        else:
            m = attn.unsqueeze(-1).to(torch.float32)
            pooled = (x2.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=-1)
