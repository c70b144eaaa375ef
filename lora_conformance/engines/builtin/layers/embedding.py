"""Token embedding with embed_tokens LoRA: E[x] + s * (A^T[x] @ B^T), routed per token."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers.linear import LoraContext


class LoraEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, ctx: LoraContext):
        super().__init__()
        self.num_embeddings, self.embedding_dim = vocab, hidden
        self.weight = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)
        self.ctx = ctx
        self.lora_At: Optional[torch.Tensor] = None  # (S, vocab, R): row lookup by token id
        self.lora_Bt: Optional[torch.Tensor] = None  # (S, R, hidden), scaling folded in
        self.slot_rank: list[int] = []
        self.shard = None  # the vocabulary slice this rank holds (layers/parallel.py); None: whole

    def alloc_pool(self, num_slots: int, rank: int) -> None:
        w = self.weight
        self.lora_At = torch.zeros(num_slots, self.num_embeddings, rank, dtype=w.dtype, device=w.device)
        self.lora_Bt = torch.zeros(num_slots, rank, self.embedding_dim, dtype=w.dtype, device=w.device)
        self.slot_rank = [0] * num_slots

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self._rows(ids)
        batch = self.ctx.batch
        if self.lora_At is None or batch is None or not any(self.slot_rank):
            return e
        S, _, R = self.lora_At.shape
        own = batch.embed_slots if batch.embed_slots is not None else batch.token_slots
        slots = own.clamp(0, S - 1)
        h = self._lora_rows(slots, ids)  # (T, R); rows of base tokens are zeroed by the one-hot below
        bt = self.lora_Bt.reshape(S * R, -1)
        if batch.delta_dtype is not None:
            h, bt = h.to(batch.delta_dtype), bt.to(batch.delta_dtype)
        onehot = batch.onehot if batch.embed_slots is None else (
            own.unsqueeze(1) == torch.arange(S, device=own.device).unsqueeze(0))
        h = (onehot.to(h.dtype).unsqueeze(2) * h.unsqueeze(1)).reshape(h.shape[0], S * R)
        d = (h @ bt).to(e.dtype)
        return e + d * batch.times

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def _lora_rows(self, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.lora_At[slots, ids]
