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


@dataclass(frozen=True)
class ExpertLora:
    """How the MoE experts apply their LoRA (defaults: correct), decided once when the engine
    loads (engine/plan.py; the other values only under the ``moe_*`` faults).

    ``shift``: expert e reads expert (e + shift) mod E's LoRA. ``first_only``: only a token's
    first (highest-weight) selected expert gets LoRA. ``weighting``: the weight of an expert's
    down_proj LoRA output: ``routed`` (the expert's routing weight, as its base output: correct),
    ``unweighted`` (1), ``next_expert`` (the weight of the token's next selected expert)."""

    shift: int = 0
    first_only: bool = False
    weighting: str = "routed"


@dataclass
class LoraBatch:
    """Routing of one forward's rows to pool slots, shared by every LoRA layer, with what the
    engine decided once about how the delta is computed (``delta_dtype``, ``times``, ``experts``):
    the layers read those here and take no switch of their own."""

    token_slots: torch.Tensor  # (T,) int64, -1 = base
    num_slots: int
    dtype: torch.dtype  # of the masks: the compute dtype
    segments: Optional[list[tuple[int, int, int]]] = None  # (slot, start, end); None -> BGMV path
    # The LoRA delta computed in this dtype and added once in the model dtype (None: the model
    # dtype, every fast path): float16 under fault lora_fp16, float32 under variant fp32_delta.
    delta_dtype: Optional[torch.dtype] = None
    times: int = 1  # fault delta_twice -> 2
    col_slots: Optional[torch.Tensor] = None  # slot of each column of a part-major layout (column_slots)
    col_rank: int = 0  # the pool rank col_slots was made for
    # None: the defaults, ExpertLora() (engine/plan.py always gives one). Not ExpertLora() as the
    # field's default: dynamo (torch 2.11) cannot trace a dataclass __init__ whose defaults hold an
    # object, and the compiled decode step broke its graph at every LoraBatch it built.
    experts: Optional[ExpertLora] = None
    # The slots the token embedding's LoRA reads (None: token_slots; other only under the fault
    # embed_tokens_lora_from_first_slot).
    embed_slots: Optional[torch.Tensor] = None
    # The slot whose adapter decides which linear layers apply LoRA for the whole batch (None: each
    # layer applies it wherever a slot holds it; other only under the fault batch_modules_of_first_adapter).
    module_gate: Optional[int] = None
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int, dtype, segments=None, delta_dtype=None, times=1,
              col_slots: Optional[torch.Tensor] = None, col_rank: int = 0, experts: ExpertLora = ExpertLora(),
              embed_slots: Optional[torch.Tensor] = None, module_gate: Optional[int] = None):
        return cls(token_slots, num_slots, dtype, segments, delta_dtype, times, col_slots, col_rank, experts,
                   embed_slots, module_gate)

    @property
    def path(self) -> str:
        """The kind of batch, which picks each layer's compute (``LinearGroup.paths``): ``segmented``
        (rows in per-slot segments), ``cast`` (masked, the delta in another dtype), ``masked``."""
        return "segmented" if self.segments is not None else "cast" if self.delta_dtype is not None else "masked"

    @property
    def onehot(self) -> torch.Tensor:
        """(T, S) in the compute dtype: row t uses slot s. Rows with slot -1 (base) or an
        out-of-range slot get an all-zero row. Made on first use (the masks rarely need it)."""
        m = self._masks.get("onehot")
        if m is None:
            ar = torch.arange(self.num_slots, device=self.token_slots.device)
            m = self._masks["onehot"] = (self.token_slots.unsqueeze(1) == ar.unsqueeze(0)).to(self.dtype)
        return m

    def mask(self, rank: int, parts: int = 1, lead: int = 0) -> torch.Tensor:
        """(T, lead + parts*S*rank) mask: ``lead`` columns of ones, then 0/1 selecting each row's
        own slot columns in a part-major (part, slot, rank) layout. Contiguous (elementwise kernels
        run vectorised) and cached per shape, so every layer of a forward shares it.

        The ones let a fused group mask its whole GEMM output [base | shrink] in one contiguous
        multiply (x * 1 is exact) instead of a strided one over the shrink columns."""
        m = self._masks.get((rank, parts, lead))
        if m is not None:
            return m
        S = self.num_slots
        if lead:
            core = self.mask(rank, parts)
            m = torch.cat([core.new_ones(core.shape[0], lead), core], dim=1)
        elif self.col_slots is not None and self.col_rank == rank and len(self.col_slots) >= parts * S * rank:
            cols = self.col_slots[: parts * S * rank]  # one compare, no repeats
            m = (self.token_slots.unsqueeze(1) == cols.unsqueeze(0)).to(self.dtype)
        else:
            m = self.onehot.repeat_interleave(rank, dim=1)
            if parts > 1:
                m = m.repeat(1, parts)
        self._masks[(rank, parts, lead)] = m
        return m

    def rows(self, index: torch.Tensor, segments=None) -> "LoraBatch":
        """The routing of a subset of rows (e.g. the positions whose logits are needed)."""
        return LoraBatch(self.token_slots[index], self.num_slots, self.dtype, segments, self.delta_dtype, self.times,
                         self.col_slots, self.col_rank, self.experts, module_gate=self.module_gate)


def column_slots(num_slots: int, rank: int, parts: int, device) -> torch.Tensor:
    """Slot index of each column of a part-major (part, slot, rank) layout, for up to ``parts``
    parts (fewer parts: a prefix). A constant per pool shape, made once, so a forward builds each
    LoRA mask with one compare."""
    return (torch.arange(parts * num_slots * rank, device=device) // rank) % num_slots


def segments_of(slots: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of equal slot index (base runs included, callers skip slot < 0)."""
    segs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            segs.append((slots[start], start, i))
            start = i
    return segs
