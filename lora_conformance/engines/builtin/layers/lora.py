"""Batched multi-LoRA kernels over a stacked slot pool (pure PyTorch).

Per target module the pool holds ``A[slot, r_max, in]`` and ``Bt[slot, r_max, out]``
(B stored transposed so both GEMMs read contiguous memory; scaling is folded into Bt).
Rows are routed by a per-token slot index, -1 for the base model. Two formulations:

* SGMV-style (prefill): tokens arrive grouped into contiguous per-slot segments; one
  shrink/expand pair per *segment* (at most max_loras_per_batch of them), using only the
  slot's own rank.
* BGMV-style (decode, graph-capturable): one slot index per row. The shrink runs against
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

    def mask(self, rank: int) -> torch.Tensor:
        """(T, S*rank) 0/1 mask selecting each row's own slot columns (cached per rank)."""
        m = self._masks.get(rank)
        if m is None:
            m = self.onehot.repeat_interleave(rank, dim=1)
            self._masks[rank] = m
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


def _cast(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, fp16: bool):
    if fp16 and x.dtype != torch.float16:
        return x.half(), A.half(), Bt.half()
    return x, A, Bt


def sgmv(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, segments, slot_rank: list[int],
         fp16: bool = False) -> Optional[torch.Tensor]:
    """Segment-grouped LoRA delta; rows of base segments (and untargeted slots) stay zero."""
    out = None
    for slot, start, end in segments:
        if slot < 0 or slot >= A.shape[0] or slot_rank[slot] == 0:
            continue
        r = slot_rank[slot]
        xs, a, bt = _cast(x[start:end], A[slot, :r], Bt[slot, :r], fp16)
        d = (xs @ a.t()) @ bt
        if out is None:
            out = x.new_zeros(x.shape[0], Bt.shape[-1])
        out[start:end] = d.to(x.dtype)
    return out


def bgmv(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Per-row-indexed LoRA delta for all rows in one shrink + one expand."""
    S, R, n_in = A.shape
    xs, a, bt = _cast(x, A.reshape(S * R, n_in), Bt.reshape(S * R, Bt.shape[-1]), batch.fp16)
    h = (xs @ a.t()) * batch.mask(R).to(xs.dtype)
    return (h @ bt).to(x.dtype)


def lora_delta(x, A, Bt, batch: LoraBatch, slot_rank: list[int]) -> Optional[torch.Tensor]:
    """The LoRA delta for x (..., in); rows of x flattened in the order of batch.token_slots."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    d = sgmv(x, A, Bt, batch.segments, slot_rank, batch.fp16) if batch.segments is not None else bgmv(x, A, Bt, batch)
    if d is None:
        return None
    if batch.times != 1:
        d = d * batch.times
    return d.view(*shape[:-1], d.shape[-1])
