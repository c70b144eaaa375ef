"""LoRA-aware linear layers: checkpoint modules (``LoraLinear``) computed through groups.

A ``LoraLinear`` is one checkpoint module (``q_proj``, ``lm_head``, ...): its base weight
and its view of a LoRA slot pool, under the module's own name so that PEFT keys map onto it.
The arithmetic lives in a ``LinearGroup``. Siblings that read the same input (q/k/v,
gate/up) share one: one base GEMM, one LoRA shrink and one LoRA expand for all of them,
instead of one of each per module. Decode is bound by kernel launches, not by FLOPs.

Group pool layout, P parts, S slots, pool rank R: ``A`` (P*S*R, in) part-major, so each
part's pool is one contiguous (S, R, in) block; ``Bt`` (P*S*R, N) block-diagonal: rows of
part k only fill part k's output columns (the other blocks stay zero). In a fused group
``A`` is stored as extra rows of the base weight, so the base GEMM also computes the shrink
for every slot. Rows then keep only their own slot through ``LoraBatch.mask`` (masked
path: fixed shapes, no host sync, graph-capturable) or, when rows come grouped into
per-slot segments, through one shrink/expand per segment (segmented path: no wasted FLOPs).
The masked expand is one GEMM over the whole block-diagonal ``Bt`` on accelerators (fewer
launches) and one GEMM per diagonal block on cpu (fewer bytes read).

Which of these a group computes is decided once, not per call: ``paths()`` maps each kind of
batch (``LoraBatch.path``: segmented, masked, or masked in a cast dtype) to this group's
compute, chosen from its layout, its fused parts and the kernel choice when those are fixed.

A single-part group whose input's producer can write into a buffer (``cat_input``: o_proj,
down_proj) stores, on accelerators, ``Bt`` as extra K rows under its base weight:
``wt`` = [W^T ; Bt] (in + S*R, out). The producer writes the input into the first ``in``
columns of a (T, in + S*R) buffer, the masked shrink goes into the rest, and one GEMM over the
whole buffer adds base + expand (``add_cat_to``): one launch fewer than base GEMM + expand GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lora_conformance.engines.builtin.layers import into, kernels
from lora_conformance.engines.builtin.layers.lora import LoraBatch


# Fused groups mask their whole GEMM output (vectorised) up to this many rows: decode batches.
FULL_MASK_MAX_ROWS = 256
# o_proj / down_proj add their expand inside the base GEMM (cat layout) up to this many rows: decode.
CAT_MAX_ROWS = 256


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
        # Views into the group's pool, allocated the first time an adapter targets the group.
        self.lora_A: Optional[torch.Tensor] = None  # (S, R, in)
        self.lora_Bt: Optional[torch.Tensor] = None  # (S, R, out), scaling folded in
        self.slot_rank: list[int] = []  # host copy: rank of each slot here (0 = not targeted)
        self.shard = None  # the slice of the checkpoint module this rank holds (layers/parallel.py); None: whole
        self.group = LinearGroup([self])

    def alloc_pool(self, num_slots: int, rank: int) -> None:
        self.group.alloc_pool(num_slots, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(x)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += self(x), in place (the residual stream: no separate add kernel)."""
        return self.group.add_to(out, x)


class LinearGroup:
    """Modules sharing an input, computed as one; output columns are the parts' in order.

    The compute weight is ``wt`` (in, N [+ S*P*R]): ``x @ wt``. On accelerators it is a
    transposed view of the row-major (out, in) weight, as ``F.linear`` reads it; on cpu it is
    stored (in, out) contiguous, which the cpu BLAS runs 2-3x faster for the few-row GEMMs
    of decode. Either way the parts' ``weight`` parameters are views into it (no second copy).
    """

    def __init__(self, parts: list[LoraLinear]):
        self.parts = list(parts)
        for p in self.parts:
            p.group = self
        self.ctx = self.parts[0].ctx
        self.in_features = self.parts[0].in_features
        self.N = sum(p.out_features for p in self.parts)
        self.fused = len(self.parts) > 1
        self.cat_input = False  # set by the model: the input's producer can write into cat_buffer()
        self.cat = False  # wt = [W^T ; Bt]: the expand rides in the base GEMM (add_cat_to)
        self.transposed = False  # wt stored (in, out) contiguous
        self.wt: Optional[torch.Tensor] = None  # set by fuse(); None: read the single part's weight live
        self.b_all: Optional[torch.Tensor] = None
        self.A: Optional[torch.Tensor] = None  # (P*S*R, in); in a fused group, columns N: of wt
        self.Bt: Optional[torch.Tensor] = None  # (P*S*R, N), block-diagonal
        self.S = self.R = 0
        self.blocks: list[tuple[slice, slice]] = []  # per part: (its rows of A/Bt, its output columns)
        self.part_starts = (0, 0)  # first output column of parts 2 and 3 (N where absent), for the expand kernel
        self._use_kernels = False  # decode LoRA through the fused kernels (layers/kernels.py)
        self._paths: Optional[dict] = None  # paths(): decided once per layout and kernel choice
        self.quant = None  # layers/int8_linear.py's Int8Base: an int8 base (no float weight, never fused)

    # ---- layout --------------------------------------------------------------------
    def fuse(self, transposed: bool) -> None:
        """Once the checkpoint is loaded: one weight for the group; the parts' become views of it."""
        self.transposed = transposed
        self._paths = None
        if self.quant is not None:  # the int8 codes are the weight: only the biases are joined
            self.b_all = self._cat_bias(0)
            return
        if self.fused or transposed:
            self._store(torch.cat([p.weight.data for p in self.parts]), self._cat_bias(0))

    def _cat_bias(self, extra: int) -> Optional[torch.Tensor]:
        if all(p.bias is None for p in self.parts):
            return None
        w = self.parts[0].weight
        bs = [p.bias.data if p.bias is not None else w.new_zeros(p.out_features) for p in self.parts]
        return torch.cat(bs + [w.new_zeros(extra)])

    def _store(self, rows: torch.Tensor, b_all: Optional[torch.Tensor]) -> None:
        """rows (N [+ S*P*R], in): the parts' weights, then (fused, with a pool) the LoRA A rows."""
        self.wt = rows.t().contiguous() if self.transposed else rows.t()
        self.b_all = b_all
        off = 0
        for p in self.parts:
            p.weight.data = self.wt[:, off: off + p.out_features].t()
            if p.bias is not None:
                p.bias.data = b_all[off: off + p.out_features]
            off += p.out_features

    def alloc_pool(self, num_slots: int, rank: int) -> None:
        w = self.parts[0].weight
        P, n_in = len(self.parts), self.in_features
        rows = num_slots * P * rank
        kw = dict(dtype=w.dtype, device=w.device)
        if self.fused and self.quant is None:  # A rides in the base weight: the base GEMM computes the shrink too
            w_all = torch.zeros(self.N + rows, n_in, **kw)
            w_all[: self.N] = self.wt[:, : self.N].t()
            self._store(w_all, self._cat_bias(rows))
            self.A = self.wt[:, self.N:].t()
        else:
            self.A = torch.zeros(rows, n_in, **kw)
        if self.cat_input and not self.fused and not self.transposed and self.quant is None:
            # Bt rides under the base weight along K: (out, in + rows) row-major, read transposed as
            # the base GEMM reads (out, in). The part's weight and lora_Bt are views of it.
            p = self.parts[0]
            w_all = torch.zeros(self.N, n_in + rows, **kw)
            w_all[:, :n_in] = p.weight.data
            self.wt = w_all.t()  # (in + rows, N)
            p.weight.data = w_all[:, :n_in]
            self.Bt = self.wt[n_in:]  # (rows, N), a strided view
            self.cat = True
        else:
            self.Bt = torch.zeros(rows, self.N, **kw)
        self.S, self.R, SR = num_slots, rank, num_slots * rank
        off, self.blocks = 0, []
        for k, p in enumerate(self.parts):
            r, c = slice(k * SR, (k + 1) * SR), slice(off, off + p.out_features)
            p.lora_A = self.A[r].view(num_slots, rank, n_in)
            p.lora_Bt = self.Bt[r, c].view(num_slots, rank, p.out_features)
            p.slot_rank = [0] * num_slots
            self.blocks.append((r, c))
            off += p.out_features
        starts = [cols.start for _, cols in self.blocks[1:]] + [self.N, self.N]
        self.part_starts = (starts[0], starts[1])

    def _base(self):
        """(in, N) weight and bias of the base model alone."""
        if self.wt is None or self.cat:  # read live: lm_head may be tied to the embedding after loading
            p = self.parts[0]
            return p.weight.t(), p.bias
        b = None if self.b_all is None else self.b_all[: self.N]
        return self.wt[:, : self.N], b

    def _used_slots(self) -> int:
        """1 + the last slot that any part holds an adapter in (pool rows past it are all zero)."""
        for s in range(self.S - 1, -1, -1):
            if any(p.slot_rank[s] for p in self.parts):
                return s + 1
        return 0

    def _batch(self) -> Optional[LoraBatch]:
        batch = self.ctx.batch
        if self.A is None or batch is None or not any(any(p.slot_rank) for p in self.parts):
            return None
        if batch.module_gate is not None and not any(p.slot_rank[batch.module_gate] for p in self.parts):
            return None  # the fault batch_modules_of_first_adapter: a layer the first adapter does not target
        return batch

    # ---- the compute path, decided once ----------------------------------------------
    @property
    def use_kernels(self) -> bool:
        return self._use_kernels

    @use_kernels.setter
    def use_kernels(self, on: bool) -> None:
        self._use_kernels = on
        self._paths = None  # decided again on the next forward

    def paths(self) -> dict:
        """What this group computes for each kind of batch (``LoraBatch.path``), decided from what
        is fixed once the checkpoint is fused and the kernels are chosen: the layout (cpu stores
        (in, out)), fused parts, fused kernels. A forward only looks its batch's kind up here."""
        if self._paths is None:
            accel = not self.transposed
            if self.fused and self.quant is None:
                masked_forward = self._fused_masked_accel if accel else self._fused_masked_cpu
            else:
                masked_forward = None  # the base GEMM, then the masked delta
            if self.use_kernels and len(self.parts) == 1:
                masked = self._delta_kernels
            else:
                masked = self._delta_masked if accel else self._delta_masked_cpu
            self._paths = {"masked": (masked_forward, masked),
                           "cast": (None, self._delta_masked),
                           "segmented": (None, self._delta_segmented)}
        return self._paths

    # ---- compute -------------------------------------------------------------------
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.N)
        if self.quant is not None:
            return self.quant.forward(self, x)
        batch = self._batch()
        if batch is None:
            return _mm(x, *self._base())
        forward, delta = self.paths()[batch.path]
        if forward is not None:
            return forward(x, batch)
        y = _mm(x, *self._base())
        delta(y, x, batch)
        return y

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += self(x), in place."""
        out2, x2 = out.view(-1, self.N), x.reshape(-1, self.in_features)
        if self.quant is not None:
            out2.add_(self.quant.forward(self, x2))
            return out
        wt, b = self._base()
        _addmm_(out2, x2, wt)
        if b is not None:
            out2.add_(b)
        batch = self._batch()
        if batch is not None:
            self.paths()[batch.path][1](out2, x2, batch)
        return out

    def _fused_masked_accel(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """Fused group, accelerator layout: one GEMM for base and every slot's shrink, one for the expand."""
        out = _mm(x, self.wt, self.b_all)  # [base | shrink against every slot]
        y = out[:, : self.N]
        if self.use_kernels and x.shape[0] <= FULL_MASK_MAX_ROWS and len(self.parts) <= 3 and y.stride(1) == 1:
            # one kernel: the own-slot mask made in registers from the slots, then the expand
            self._expand(y, out[:, self.N:], batch, batch.times)
            return y
        if x.shape[0] <= FULL_MASK_MAX_ROWS:
            # Launch-bound (decode): mask all of out, base columns times 1 (exact), in one
            # contiguous, vectorised multiply instead of a strided one over the shrink columns.
            out.mul_(batch.mask(self.R, len(self.parts), lead=self.N))
        else:  # many rows (prefill): bytes matter, touch the shrink columns only
            out[:, self.N:].mul_(batch.mask(self.R, len(self.parts)))
        y.addmm_(out[:, self.N:], self.Bt, alpha=batch.times)
        return y

    def _fused_masked_cpu(self, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """Fused group, cpu layout: base and shrink in one GEMM, the expand per part."""
        out = _mm(x, self.wt, self.b_all)
        y = out[:, : self.N]
        self._delta_masked_cpu(y, x, batch, h=out[:, self.N:])
        return y


    def _expand(self, y: torch.Tensor, h: torch.Tensor, batch: LoraBatch, alpha) -> None:
        """y += alpha * (each row's own slot columns of h) @ (that slot's Bt rows), per part (kernel)."""
        c1, c2 = self.part_starts
        kernels.ops.lora_expand_(y, h, self.Bt, batch.token_slots, self.S, self.R, c1, c2, float(alpha))

    # ---- expand in the base GEMM (cat layout) ---------------------------------------
    def cat_batch(self, rows: int) -> Optional[LoraBatch]:
        """The routing if this forward takes the cat path (``add_cat_to``), else None: masked
        (decode-sized, unsegmented) batches on the accelerator layout, delta in the model dtype."""
        if not self.cat or rows > CAT_MAX_ROWS:
            return None
        batch = self._batch()
        if batch is None or batch.path != "masked":
            return None
        return batch

    def cat_buffer(self, rows: int) -> torch.Tensor:
        """(rows, in + S*R): the producer writes the input into [:, :in] (``cat_input_view``).
        One per shape and forward, shared by every layer (each layer's GEMM reads it before the
        next layer's producer writes it: one stream), cached beside the forward's masks. The
        key leaves the row count out (one forward, one count; the shape check covers the rest):
        under torch.compile a row count in a dict key pins the dynamic batch size to its value, and
        every batch size compiled the whole decoder again."""
        batch = self.ctx.batch
        key = ("cat_buffer", self.wt.shape[0], self.wt.dtype, self.wt.device)
        buf = batch._masks.get(key)
        if buf is None or buf.shape[0] != rows:
            buf = batch._masks[key] = self.wt.new_empty(rows, self.wt.shape[0])
        return buf

    def cat_input_view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, : self.in_features]

    def add_cat_to(self, out: torch.Tensor, buf: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """out += self(buf[:, :in]), in place: shrink, mask into buf[:, in:], then ONE GEMM
        [x | masked shrink] @ [W^T ; Bt] for base + expand."""
        n_in = self.in_features
        out2, x = out.view(-1, self.N), buf[:, :n_in]
        lo = buf[:, n_in:]
        if self.use_kernels:  # own slot's shrink, other slots' columns zero: one kernel
            kernels.ops.lora_shrink(x, self.A, batch.token_slots, lo, self.S, self.R, float(batch.times))
        else:
            into(lo, torch.mul, torch.mm(x, self.A.t()), batch.mask(self.R, 1))
            if batch.times != 1:  # fault delta_twice: the expand counted times over
                lo.mul_(batch.times)
        out2.addmm_(buf, self.wt)
        b = self.parts[0].bias
        if b is not None:
            out2.add_(b)
        return out

    def _delta_kernels(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """Single-part group: own-slot shrink, then own-slot expand (two kernels), for decode-sized
        batches whose tensors have contiguous rows; else the layout's masked GEMMs."""
        if x.shape[0] <= FULL_MASK_MAX_ROWS and kernels.rows_ok(out, x, self.A, self.Bt):
            S, R = self.S, self.R
            h = x.new_empty(x.shape[0], S * R)
            kernels.ops.lora_shrink(x, self.A, batch.token_slots, h, S, R, 1.0)
            self._expand(out, h, batch, batch.times)
            return
        (self._delta_masked_cpu if self.transposed else self._delta_masked)(out, x, batch)

    def _delta_masked(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """out += the masked delta over every slot at once (accelerators; any layout in a cast dtype)."""
        _delta_into(out, x, self.A, self.Bt, batch.mask(self.R, len(self.parts)), batch, None)

    def _delta_masked_cpu(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch, h=None) -> None:
        """The masked delta on the cpu layout (eager only, never graph-captured): bytes, not launches,
        bound it there, so trailing slots that no part holds (all-zero pool rows) are not read.
        h: x's shrink against every slot, if already computed."""
        mask = batch.mask(self.R, len(self.parts))
        n = self._used_slots() * self.R
        if len(self.parts) == 1:
            _delta_into(out, x, self.A[:n], self.Bt[:n], mask[:, :n], batch, None if h is None else h[:, :n])
            return
        h = _mm(x, self.A.t(), None) if h is None else h
        h.mul_(mask)
        for rows, cols in self.blocks:
            r = slice(rows.start, rows.start + n)
            _addmm_(out[:, cols], h[:, r], self.Bt[r, cols], batch.times)

    def _delta_segmented(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """One shrink/expand per (adapter segment, part that the adapter targets)."""
        S, R = self.S, self.R
        for slot, start, end in batch.segments:
            if not 0 <= slot < S:
                continue
            for k, (rows, cols) in enumerate(self.blocks):
                if self.parts[k].slot_rank[slot]:
                    r = slice(rows.start + slot * R, rows.start + (slot + 1) * R)
                    _delta_into(out[start:end, cols], x[start:end], self.A[r], self.Bt[r, cols], None, batch)


def _cpu_half(t: torch.Tensor) -> bool:
    return t.dtype == torch.float16 and t.device.type == "cpu"


# float16 on cpu: torch's own half GEMM there sums in float32 and rounds once (the same bits as
# the float32 GEMM of the half inputs, up to summation order: 99.9% of elements equal), but runs
# 20-60x slower than the float32 GEMM on cpus without half arithmetic. These two compute exactly
# that, the float32 GEMM of the half values, rounded once; every other device and dtype is as is.


def _mm(x: torch.Tensor, wt: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    if _cpu_half(x):
        return _mm(x.float(), wt.float(), None if b is None else b.float()).half()
    return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)


def _addmm_(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, alpha=1) -> torch.Tensor:
    """out += alpha * x @ w, in place."""
    if _cpu_half(out):
        return out.copy_(torch.addmm(out.float(), x.float(), w.float(), alpha=alpha))
    return out.addmm_(x, w, alpha=alpha)


def _delta_into(out, x, A, Bt, mask, batch: LoraBatch, h=None) -> None:
    """out += times * ((x @ A^T) [* mask]) @ Bt; h: x @ A^T if already computed."""
    dd = batch.delta_dtype
    if dd is not None and x.dtype != dd:  # fault lora_fp16 (half) / variant fp32_delta (float)
        h = x.to(dd) @ A.to(dd).t()
        if mask is not None:
            h = h * mask.to(dd)
        out.add_((h @ Bt.to(dd)).to(out.dtype), alpha=batch.times)
        return
    h = _mm(x, A.t(), None) if h is None else h
    if mask is not None:
        h.mul_(mask)
    _addmm_(out, h, Bt, batch.times)


def fuse_linear_groups(model: nn.Module, transposed: bool) -> None:
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, LoraLinear)}
    for g in groups.values():
        g.fuse(transposed)
