"""Attention over a paged KV cache.

One cache tensor per layer, ``(num_blocks, block_size, 2, kv_heads, head_dim)``: a token's
key and value sit side by side, and so do k and v in the fused qkv projection's output,
so every step writes both with one index_copy and reads a sequence's context with one
gather. Prefill and decode share the write and the gather; decode (one query per sequence)
skips the query padding and folds the query heads that share a KV head into SDPA's query
length, so it needs no grouped-query support from the attention kernel. All shapes are
fixed by (sequences, query length, block-table width), so decode can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of each new token (padding -> scratch block 0)
    block_tables: torch.Tensor  # (B, W) block ids, padded with 0
    q_index: Optional[torch.Tensor]  # (B, Lq) index into the T new tokens (+1 padding row at index T); None: decode
    out_index: Optional[torch.Tensor]  # (T,) where token t sits in the flattened (B*Lq) query grid
    mask: torch.Tensor  # (B, 1, Lq, W*block_size) additive (0 / -inf, model dtype): which keys each query sees


def build_mask(ctx_lens: torch.Tensor, q_lens: torch.Tensor, Lq: int, Lk: int) -> torch.Tensor:
    """Causal mask with a cached-prefix offset; padded query rows see key 0 (avoids NaN)."""
    dev = ctx_lens.device
    i = torch.arange(Lq, device=dev).view(1, Lq, 1)
    j = torch.arange(Lk, device=dev).view(1, 1, Lk)
    start = (ctx_lens - q_lens).view(-1, 1, 1)  # tokens already in the cache before this step
    allowed = (j <= start + i) & (j < ctx_lens.view(-1, 1, 1))
    pad_row = i >= q_lens.view(-1, 1, 1)
    allowed = allowed | (pad_row & (j == 0))
    return allowed.unsqueeze(1)


def decode_mask(ctx_lens: torch.Tensor, Lk: int, dtype) -> torch.Tensor:
    """``additive_mask(build_mask(ctx_lens, 1, 1, Lk))`` in four kernels instead of a dozen: with one
    query per sequence at position ctx-1, the causal rule and the length rule both reduce to j < ctx."""
    blocked = torch.arange(Lk, device=ctx_lens.device).view(1, Lk) >= ctx_lens.view(-1, 1)
    B = ctx_lens.shape[0]
    out = torch.zeros((B, 1, 1, Lk), dtype=dtype, device=ctx_lens.device)
    return out.masked_fill_(blocked.view(B, 1, 1, Lk), float("-inf"))


def additive_mask(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """Boolean mask -> 0 / -inf, as SDPA converts it itself; done once per step, not once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


# Decode with ``out``: copy the attention output into ``out`` even where (T, H*D) is a free view
# of it (tests set this to run the o_proj cat path on backends whose output needs no copy).
DECODE_OUT_ALWAYS = False


def paged_attention(qkv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                    scale: float, out: Optional[torch.Tensor] = None, copy_out: bool = False) -> torch.Tensor:
    """qkv (T, (H + 2*KVH)*D): rotated q and k, then v; cache (num_blocks, block_size, 2, KVH, D).
    Returns (T, H*D). Decode with ``out`` (a (T, H*D) view, rows may be strided): where the SDPA
    output is laid out so that (T, H*D) needs a copy anyway, that copy writes into ``out`` and
    ``out`` is returned; else the free view is returned and ``out`` is left untouched, unless
    ``copy_out`` (the caller's next step is cheaper from ``out`` than the copy costs)."""
    kvh, D = kv_cache.shape[-2], kv_cache.shape[-1]
    H, T = num_heads, qkv.shape[0]
    kv_cache.view(-1, 2 * kvh * D).index_copy_(0, meta.slot_mapping, qkv[:, H * D:(H + 2 * kvh) * D])
    B = meta.block_tables.shape[0]
    # index_select on whole blocks: row copies (advanced indexing is several times slower on cpu)
    ctx = kv_cache.view(kv_cache.shape[0], -1).index_select(0, meta.block_tables.view(-1)).view(B, -1, 2, kvh, D)
    keys, vals = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)  # (B, KVH, L, D)
    q = qkv[:, : H * D]
    if meta.q_index is None:  # decode: row b is sequence b; head h = kv head h // G, so group g rides in Lq
        dest = out
        o = F.scaled_dot_product_attention(q.view(B, kvh, H // kvh, D), keys, vals, attn_mask=meta.mask,
                                           scale=scale)  # (B, KVH, G, D)
        flat = _free_view(o, (B, H * D))
        if dest is None or (flat is not None and not (DECODE_OUT_ALWAYS or copy_out)):
            return o.reshape(B, H * D) if flat is None else flat
        dest.view(B, kvh, H // kvh, D).copy_(o)  # the copy reshape would make, into the caller's buffer
        return dest
    q = q.view(T, H, D)
    qp = torch.cat([q, q.new_zeros(1, H, D)], dim=0)[meta.q_index]  # (B, Lq, H, D)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, vals, attn_mask=meta.mask, scale=scale,
        enable_gqa=kvh != H,  # grouped-query attention without materialising repeated K/V
    )  # (B, H, Lq, D)
    out = out.transpose(1, 2).reshape(-1, H * D)
    return out[meta.out_index]


def _free_view(t: torch.Tensor, shape) -> Optional[torch.Tensor]:
    """t.view(shape) where that needs no copy, else None. Under torch.compile always None (the
    caller reshapes): a view that fails inside a traced region is a compile error, not the
    RuntimeError caught here (float32 decode on an H200, torch 2.11)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return t.view(shape)
    except RuntimeError:
        return None
