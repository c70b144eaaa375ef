"""Attention over a paged KV cache.

Every step (prefill or decode) first writes the new keys/values into their cache slots,
then each sequence attends over its whole context gathered from its block table. Prefill
and decode share the code: decode is the case of one query per sequence. All shapes are
fixed by (sequences, query length, block-table width), so decode can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of each new token (padding -> scratch block 0)
    block_tables: torch.Tensor  # (B, W) block ids, padded with 0
    q_index: torch.Tensor  # (B, Lq) index into the T new tokens (+1 padding row at index T)
    out_index: torch.Tensor  # (T,) where token t sits in the flattened (B*Lq) query grid
    mask: torch.Tensor  # (B, 1, Lq, W*block_size) bool: which keys each query may see


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


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D); caches (num_blocks, block_size, KVH, D). Returns (T, H*D)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    k_cache.view(-1, kvh, D).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, D).index_copy_(0, meta.slot_mapping, v)
    B, W = meta.block_tables.shape
    keys = k_cache[meta.block_tables].reshape(B, -1, kvh, D)
    vals = v_cache[meta.block_tables].reshape(B, -1, kvh, D)
    qp = torch.cat([q, q.new_zeros(1, H, D)], dim=0)[meta.q_index]  # (B, Lq, H, D)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=meta.mask, scale=scale,
        enable_gqa=kvh != H,  # grouped-query attention without materialising repeated K/V
    )  # (B, H, Lq, D)
    out = out.transpose(1, 2).reshape(-1, H * D)
    return out[meta.out_index]
