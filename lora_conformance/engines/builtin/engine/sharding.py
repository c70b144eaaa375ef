"""A rank's cut of an adapter's packed factors, for its slot pools (layers/parallel.py says why
each layer kind is cut as it is).

Every rank receives the whole packed adapter (engine/adapter.py: A (R, in), Bt (R, out) with
the scaling folded into Bt; an embedding's At (vocab, R)) and keeps its shard:

* column-parallel linear: A whole, Bt's columns of the rank's output slice, each packed part
  (q, k, v; gate, up) cut on its own, since each checkpoint module is one part;
* row-parallel linear: A's columns of the rank's input slice; Bt on rank 0, zeros elsewhere
  (the expand is added once, before the output's all-reduce);
* vocab-parallel embedding: At's rows of the rank's vocabulary slice, Bt whole;
* anything unsharded (one device, MoE experts): as packed.

``ShardRules`` are decided once, at load (engine/plan.py): the defaults are correct; the
others are the catalogue's tensor-parallel faults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardRules:
    b_rank_offset: int = 0  # column-parallel Bt cut at rank (r + offset) mod size's slice
    packed_as_one_block: bool = False  # a fused group's Bt cut from the parts' packed output as one block
    row_b_on_every_rank: bool = False  # row-parallel Bt (scaling folded in) kept whole on every rank


class Sharder:
    def __init__(self, lora_modules: dict, rules: ShardRules = ShardRules()):
        self.modules, self.rules = lora_modules, rules
        self.name_of = {id(m): n for n, (_, m) in lora_modules.items()}

    def cut(self, name: str, packed, adapter) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, Bt) of module ``name`` as this rank's pool holds them."""
        _, mod = self.modules[name]
        shard = getattr(mod, "shard", None)
        if shard is None:
            return packed.A, packed.Bt
        if shard.kind == "vocab":
            return packed.A[shard.start: shard.end], packed.Bt
        if shard.kind == "row":
            keep_b = shard.rank == 0 or self.rules.row_b_on_every_rank
            return packed.A[:, shard.start: shard.end], packed.Bt if keep_b else torch.zeros_like(packed.Bt)
        if self.rules.packed_as_one_block and len(mod.group.parts) > 1:
            return packed.A, self._from_packed_block(mod, adapter, packed)
        r = (shard.rank + self.rules.b_rank_offset) % shard.size
        start = r * shard.width
        return packed.A, packed.Bt[:, start: start + shard.width]

    def _from_packed_block(self, mod, adapter, packed) -> torch.Tensor:
        """Fault tp_packed_slice_as_one_block: the parts' Bt side by side as one (R, sum of full
        outputs) block, the rank's equal share of it cut, and this part's local width taken from
        where the part sits in the rank's packed output."""
        parts = mod.group.parts
        blocks, offset = [], 0
        for p in parts:
            other = adapter.modules.get(self.name_of[id(p)])
            blocks.append(other.Bt if other is not None else packed.Bt.new_zeros(packed.Bt.shape[0], p.shard.full))
        whole = torch.cat(blocks, dim=1)
        local_total = sum(p.shard.width for p in parts)
        rank_block = whole[:, mod.shard.rank * local_total: (mod.shard.rank + 1) * local_total]
        for p in parts:
            if p is mod:
                return rank_block[:, offset: offset + p.shard.width]
            offset += p.shard.width
        raise AssertionError("a module is a part of its own group")
