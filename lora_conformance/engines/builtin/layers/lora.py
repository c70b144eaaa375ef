"""Routing of a forward's rows to LoRA pool slots, shared by every LoRA layer.

Per target module the pool holds ``A[slot, r_max, in]`` and ``Bt[slot, r_max, out]``
(B stored transposed so both GEMMs read contiguous memory; scaling is folded into Bt).
Rows are routed by a per-token slot index, -1 for the base model. Two formulations
(computed in ``linear.LinearGroup``):

* segmented (SGMV-style): tokens arrive grouped into contiguous per-slot segments; one
  shrink/expand pair per *segment*. No wasted FLOPs, one host-side loop per segment.
* masked (BGMV-style, graph-capturable): one slot index per row. The shrink runs against
  every slot at once (in -> slots*r_max) and a per-row one-hot mask keeps only the row's
  own slot before the expand. No gather of weights per row, no host sync, fixed shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class LoraBatch:
    """Routing of one forward's rows to pool slots, shared by every LoRA layer."""

    token_slots: torch.Tensor  # (T,) int64, -1 = base
    onehot: torch.Tensor  # (T, S) in the compute dtype: row t uses slot s
    segments: Optional[list[tuple[int, int, int]]] = None  # (slot, start, end); None -> BGMV path
    fp16: bool = False  # fault lora_fp16
    times: int = 1  # fault delta_twice -> 2
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int, dtype, segments=None, fp16=False, times=1):
        # Rows with slot -1 (base) or an out-of-range slot get an all-zero one-hot row.
        ar = torch.arange(num_slots, device=token_slots.device)
        onehot = (token_slots.unsqueeze(1) == ar.unsqueeze(0)).to(dtype)
        return cls(token_slots, onehot, segments, fp16, times)

    def mask(self, rank: int, parts: int = 1) -> torch.Tensor:
        """(T, parts*S*rank) 0/1 mask selecting each row's own slot columns in a part-major
        (part, slot, rank) layout; cached per shape, so every layer of a forward shares it."""
        m = self._masks.get((rank, parts))
        if m is None:
            m = self.onehot.repeat_interleave(rank, dim=1)
            if parts > 1:
                m = m.repeat(1, parts)
            self._masks[(rank, parts)] = m
        return m

    def rows(self, index: torch.Tensor, segments=None) -> "LoraBatch":
        """The routing of a subset of rows (e.g. the positions whose logits are needed)."""
        return LoraBatch(self.token_slots[index], self.onehot[index], segments, self.fp16, self.times)


def segments_of(slots: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of equal slot index (base runs included, callers skip slot < 0)."""
    segs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            segs.append((slots[start], start, i))
            start = i
    return segs
