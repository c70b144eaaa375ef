"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3 and the MoE variants' shared skeleton).

Module names mirror the HF checkpoints (``model.layers.N.self_attn.q_proj``, ``lm_head``),
so PEFT adapter keys map onto our LoRA layers by name.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers import into, kernels
from lora_conformance.engines.builtin.layers.attention import AttentionMetadata, paged_attention
from lora_conformance.engines.builtin.layers.embedding import LoraEmbedding
from lora_conformance.engines.builtin.layers.linear import LinearGroup, LoraContext, LoraLinear
from lora_conformance.engines.builtin.layers.lora import LoraBatch
from lora_conformance.engines.builtin.layers.parallel import (TensorParallel, VocabParallelEmbedding, parallel_linear,
                                                              split_evenly)
from lora_conformance.engines.builtin.layers.rmsnorm import RMSNorm
from lora_conformance.engines.builtin.layers.rotary import RotaryEmbedding
from lora_conformance.engines.builtin.models.config import ModelSpec

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: LoraContext, tp: Optional[TensorParallel] = None):
        """tp: q/k/v hold this rank's heads (column-parallel), o_proj their input (row-parallel)."""
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        size = 1 if tp is None else tp.size
        self.num_heads = split_evenly("attention heads", spec.num_heads, size)
        self.num_kv_heads = split_evenly("key/value heads", spec.num_kv_heads, size)
        self.head_dim = d
        self.q_proj = parallel_linear(h, spec.num_heads * d, spec.qkv_bias, ctx, tp, "column", d)
        self.k_proj = parallel_linear(h, spec.num_kv_heads * d, spec.qkv_bias, ctx, tp, "column", d)
        self.v_proj = parallel_linear(h, spec.num_kv_heads * d, spec.qkv_bias, ctx, tp, "column", d)
        self.qkv = LinearGroup([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = parallel_linear(spec.num_heads * d, h, spec.o_bias, ctx, tp, "row", d)
        # decode attention can write its output into o_proj's buffer (one device only)
        self.o_proj.group.cat_input = tp is None
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.scale = d**-0.5
        self.use_kernels = False  # rotary in one fused kernel (layers/kernels.py)

    def add_to(self, residual, x, rope, kv_cache, meta: AttentionMetadata):
        """residual += o_proj(attention(x)), in place."""
        T, H = x.shape[0], self.num_heads
        qkv = self.qkv(x)  # (T, (H + 2*KVH) * D)
        qk = qkv[:, : (H + self.num_kv_heads) * self.head_dim].view(T, -1, self.head_dim)
        src = qk
        if self.q_norm is not None:
            src = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        if self.use_kernels:
            kernels.ops.rope_(src, rope[0], rope[1], qk)
        else:
            RotaryEmbedding.apply(src, rope, out=qk)  # rotated in place: the cache write reads k from qkv
        o = self.o_proj.group
        batch = o.cat_batch(T) if meta.q_index is None else None
        if batch is not None:  # decode: the attention output lands in o_proj's [x | shrink] buffer
            buf = o.cat_buffer(T)
            x_in = o.cat_input_view(buf)
            # With the fused kernels, copy + own-slot shrink + one GEMM (3 launches) beats base GEMM +
            # split-K shrink (2) + mask + expand on the free view: copy even where a view is free.
            att = paged_attention(qkv, kv_cache, meta, H, self.scale, out=x_in, copy_out=self.use_kernels)
            if att is x_in:
                return o.add_cat_to(residual, buf, batch)
            # the attention output was a free view: copying it into buf would cost what the cat path saves
            return self.o_proj.add_to(residual, att)
        return self.o_proj.add_to(residual, paged_attention(qkv, kv_cache, meta, H, self.scale))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, ctx: LoraContext, tp: Optional[TensorParallel] = None):
        """tp: gate/up hold this rank's rows (column-parallel), down_proj their input (row-parallel)."""
        super().__init__()
        self.gate_proj = parallel_linear(hidden, inter, False, ctx, tp, "column")
        self.up_proj = parallel_linear(hidden, inter, False, ctx, tp, "column")
        self.gate_up = LinearGroup([self.gate_proj, self.up_proj])
        self.down_proj = parallel_linear(inter, hidden, False, ctx, tp, "row")
        # act(gate) * up can be written into down_proj's buffer (one device only)
        self.down_proj.group.cat_input = tp is None
        inter = self.gate_proj.out_features
        self.act, self.inter = ACTIVATIONS[act], inter
        self.silu = act == "silu"
        self.use_kernels = False  # silu(gate) * up in one fused kernel (layers/kernels.py)

    def _act_mul(self, gu, out=None):
        """act(gate) * up, into ``out`` if given."""
        if self.use_kernels and self.silu and kernels.rows_ok(gu) and (out is None or kernels.rows_ok(out)):
            out = gu.new_empty(gu.shape[0], self.inter) if out is None else out
            kernels.ops.silu_mul(gu, self.inter, out)
            return out
        if out is None:
            return self.act(gu[..., : self.inter]).mul_(gu[..., self.inter:])  # in place: one buffer fewer
        return into(out, torch.mul, self.act(gu[:, : self.inter]), gu[:, self.inter:])

    def _inner(self, x):
        return self._act_mul(self.gate_up(x))

    def forward(self, x):
        return self.down_proj(self._inner(x))

    def add_to(self, residual, x):
        d = self.down_proj.group
        batch = d.cat_batch(x.shape[0]) if x.dim() == 2 else None
        if batch is None:
            return self.down_proj.add_to(residual, self._inner(x))
        gu = self.gate_up(x)
        buf = d.cat_buffer(x.shape[0])  # act(gate) * up lands in down_proj's [x | shrink] buffer
        self._act_mul(gu, out=d.cat_input_view(buf))
        return d.add_cat_to(residual, buf, batch)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, ctx: LoraContext, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = Attention(spec, ctx, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        if spec.is_moe_layer(index):
            from lora_conformance.engines.builtin.models.moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(spec, ctx)  # whole on every rank: the experts are not sharded
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act, ctx, tp)

    def forward(self, x, rope, kv_cache, meta):
        """Updates the residual stream x in place (the output projections accumulate into it)."""
        self.self_attn.add_to(x, self.input_layernorm(x), rope, kv_cache, meta)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, DenseMLP):
            return self.mlp.add_to(x, h)
        return x.add_(self.mlp(h))


class DecoderBody(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: LoraContext, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.embed_tokens = (LoraEmbedding(spec.vocab_size, spec.hidden_size, ctx) if tp is None else
                             VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, ctx, tp))
        self.layers = nn.ModuleList(DecoderLayer(spec, i, ctx, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)


class CausalLM(nn.Module):
    """``forward`` runs the stack over the new tokens; ``logits`` projects chosen rows."""

    def __init__(self, spec: ModelSpec, max_len: int, device, dtype, rope_exponent_dim: int = 0,
                 tp: Optional[TensorParallel] = None):
        """tp: this rank's TensorParallel (layers/parallel.py): the layers hold its shards and
        ``forward`` returns the whole vocabulary's logits on every rank."""
        super().__init__()
        self.spec, self.tp = spec, tp
        self.lora_ctx = LoraContext()
        if tp is not None:
            split_evenly("vocabulary", spec.vocab_size, tp.size)
        self.model = DecoderBody(spec, self.lora_ctx, tp)
        self.kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's, in the KV cache
        self.lm_head = parallel_linear(spec.hidden_size, spec.vocab_size, False, self.lora_ctx, tp, "column")
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, max_len, device, dtype,
                                      rope_exponent_dim)
        self.kv_caches: list[torch.Tensor] = []  # per layer (num_blocks, block_size, 2, KVH, D)

    def forward(self, input_ids, positions, meta: AttentionMetadata, lora: Optional[LoraBatch],
                logit_rows: Optional[torch.Tensor], lora_logits: Optional[LoraBatch]) -> torch.Tensor:
        """logit_rows None: logits for every row."""
        self.lora_ctx.batch = lora
        try:
            x = self.model.embed_tokens(input_ids)
            rope = self.rotary.lookup(positions)
            for layer, kv in zip(self.model.layers, self.kv_caches):
                x = layer(x, rope, kv, meta)
            x = self.model.norm(x if logit_rows is None else x[logit_rows])
            self.lora_ctx.batch = lora_logits
            logits = self.lm_head(x)
            if self.tp is not None:  # each rank holds a slice of the vocabulary
                logits = self.tp.gather_last(logits, self.spec.vocab_size)
            return logits.float()
        finally:
            self.lora_ctx.batch = None
