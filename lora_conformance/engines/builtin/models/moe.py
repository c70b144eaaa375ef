"""Sparse MoE block with experts fused as 3-D parameters (transformers 5 layout) and expert LoRA.

Expert LoRA follows PEFT ``target_parameters``: per expert e, delta W_e = s * B_e @ A_e.
The pool is laid out expert-major, ``A[e, slot, r, in]`` / ``Bt[e, slot, r, out]``, so the
per-expert masked shrink/expand reads one contiguous block per expert.

Each selected expert's output, its LoRA delta included, is multiplied by the token's routing
weight for that expert. How (``LoraBatch.experts``, decided once when the engine loads; only the
``moe_*`` faults change it): which expert's LoRA is read, which of a token's selected experts get
LoRA at all, and which weight the down_proj LoRA output is given.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lora_conformance.engines.builtin.layers.linear import LoraContext, LoraLinear
from lora_conformance.engines.builtin.layers.lora import ExpertLora
from lora_conformance.engines.builtin.models.config import ModelSpec
from lora_conformance.engines.builtin.models.llama import ACTIVATIONS, DenseMLP


class ExpertParam(nn.Module):
    """One fused expert weight (E, out, in) plus its LoRA slot pool."""

    def __init__(self, E: int, out_f: int, in_f: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, out_f, in_f), requires_grad=False)
        self.lora_A: Optional[torch.Tensor] = None  # (E, S, R, in)
        self.lora_Bt: Optional[torch.Tensor] = None  # (E, S, R, out)
        self.slot_rank: list[int] = []

    def alloc_pool(self, num_slots: int, rank: int) -> None:
        E, out_f, in_f = self.weight.shape
        kw = dict(dtype=self.weight.dtype, device=self.weight.device)
        self.lora_A = torch.zeros(E, num_slots, rank, in_f, **kw)
        self.lora_Bt = torch.zeros(E, num_slots, rank, out_f, **kw)
        self.slot_rank = [0] * num_slots

    def apply(self, x: torch.Tensor, e: int, rows: torch.Tensor, ctx: LoraContext, shift: int = 0,
              keep: Optional[torch.Tensor] = None, split: bool = False):
        """Expert ``e``'s output for rows ``x`` (token indices ``rows``), its LoRA delta added, or
        ``(base, delta)`` with ``split`` (delta None without LoRA). ``shift`` / ``keep`` (a 0/1 per
        row) differ from the defaults only under the expert-level faults (``LoraBatch.experts``)."""
        y = F.linear(x, self.weight[e])
        batch = ctx.batch
        if self.lora_A is None or batch is None or not any(self.slot_rank):
            return (y, None) if split else y
        le = (e + shift) % self.weight.shape[0]
        _, S, R, n_in = self.lora_A.shape
        a, bt = self.lora_A[le].reshape(S * R, n_in), self.lora_Bt[le].reshape(S * R, -1)
        xs = x
        if batch.delta_dtype is not None:
            xs, a, bt = x.to(batch.delta_dtype), a.to(batch.delta_dtype), bt.to(batch.delta_dtype)
        mask = batch.mask(R)[rows].to(xs.dtype)
        if keep is not None:
            mask = mask * keep[:, None].to(xs.dtype)
        delta = ((xs @ a.t()) * mask @ bt).to(y.dtype) * batch.times
        return (y, delta) if split else y + delta


class FusedExperts(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: LoraContext):
        super().__init__()
        E, H, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.num_experts, self.ctx = E, ctx
        self.gate_up_proj = ExpertParam(E, 2 * inter, H)
        self.down_proj = ExpertParam(E, H, inter)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x, top_idx, top_w):
        out = torch.zeros_like(x)
        # One host sync per MoE layer to find the experts hit; MoE decode therefore runs eagerly.
        hit = torch.bincount(top_idx.flatten(), minlength=self.num_experts).nonzero().flatten().tolist()
        f = (self.ctx.batch.experts if self.ctx.batch is not None else None) or ExpertLora()
        for e in hit:
            rows, which = torch.where(top_idx == e)
            keep = (which == 0) if f.first_only else None
            gate, up = self.gate_up_proj.apply(x[rows], e, rows, self.ctx, f.shift, keep).chunk(2, dim=-1)
            if f.weighting == "routed":
                h = self.down_proj.apply(self.act(gate) * up, e, rows, self.ctx, f.shift, keep)
                h = h * top_w[rows, which, None]
            else:
                y, delta = self.down_proj.apply(self.act(gate) * up, e, rows, self.ctx, f.shift, keep, split=True)
                h = y * top_w[rows, which, None]
                if delta is not None:
                    w = (top_w[rows, (which + 1) % top_w.shape[1], None] if f.weighting == "next_expert"
                         else torch.ones_like(top_w[rows, which, None]))
                    h = h + delta * w
            out.index_add_(0, rows, h.to(out.dtype))
        return out


class Router(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size), requires_grad=False)
        self.top_k, self.norm, self.fp32 = spec.top_k_experts, spec.norm_topk_prob, spec.router_probs_in_fp32

    def forward(self, x):
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, (top_w if self.fp32 else top_w.to(logits.dtype))


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: LoraContext):
        super().__init__()
        self.gate = Router(spec)
        self.experts = FusedExperts(spec, ctx)
        self.shared_expert = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(spec.hidden_size, spec.shared_expert_intermediate_size, spec.hidden_act, ctx)
            self.shared_expert_gate = LoraLinear(spec.hidden_size, 1, False, ctx)

    def forward(self, x):
        top_idx, top_w = self.gate(x)
        out = self.experts(x, top_idx, top_w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
