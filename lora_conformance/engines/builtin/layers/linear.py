"""A linear layer whose weight is the base model's and whose LoRA lives in a slot pool."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers.lora import LoraBatch, lora_delta


class LoraContext:
    """The routing of the current forward, set by the model runner and read by every LoRA layer."""

    def __init__(self):
        self.batch: Optional[LoraBatch] = None


class LoraLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: LoraContext):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.ctx = ctx
        # Allocated lazily by the adapter pool the first time an adapter targets this module.
        self.lora_A: Optional[torch.Tensor] = None  # (S, R, in)
        self.lora_Bt: Optional[torch.Tensor] = None  # (S, R, out), scaling folded in
        self.slot_rank: list[int] = []  # host copy: rank of each slot here (0 = not targeted)

    def alloc_pool(self, num_slots: int, rank: int) -> None:
        w = self.weight
        self.lora_A = torch.zeros(num_slots, rank, self.in_features, dtype=w.dtype, device=w.device)
        self.lora_Bt = torch.zeros(num_slots, rank, self.out_features, dtype=w.dtype, device=w.device)
        self.slot_rank = [0] * num_slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        batch = self.ctx.batch
        if self.lora_A is not None and batch is not None and any(self.slot_rank):
            d = lora_delta(x, self.lora_A, self.lora_Bt, batch, self.slot_rank)
            if d is not None:
                y = y + d
        return y
