"""Tensor parallelism: the ranks' collectives, how each module is sharded, and the row-parallel group.

Every rank holds the whole residual stream; the layers between are split (Megatron style):

* column-parallel (q/k/v, gate/up, lm_head): each rank holds a slice of the output features,
  of each packed part on its own (rank r's q heads, k heads and v heads; its gate and up
  rows). LoRA A is whole on every rank; LoRA B is sliced like the base output.
* row-parallel (o_proj, down_proj): each rank holds a slice of the input features and computes
  a partial output; one all-reduce sums them. LoRA A is sliced like the base input, so each
  rank's shrink is partial too: it is all-reduced on its own (a (tokens, slots x rank) tensor),
  and the expand, scaling folded in, is added once -- rank 0 holds B, the other ranks zeros --
  before the output's all-reduce.
* vocab-parallel embedding: each rank holds a slice of the vocabulary rows (and of the
  embedding LoRA's A rows); a token outside the slice reads zeros, and one all-reduce each
  for the output and the LoRA shrink gathers them. lm_head's slices are gathered to the full
  vocabulary with an all-gather.

Which slice a module holds is a ``Shard``, fixed when the model is built; the adapter's
factors are cut to it when they are copied into the rank's slot pool (engine/sharding.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lora_conformance.engines.builtin.layers.embedding import LoraEmbedding
from lora_conformance.engines.builtin.layers.linear import LinearGroup, LoraContext, LoraLinear, _addmm_, _mm
from lora_conformance.engines.builtin.layers.lora import LoraBatch


class TensorParallel:
    """One rank's view of the tensor-parallel group: its rank, the size, and the collectives
    (a torch.distributed process group of the device's backend, made without the global default
    group, so several engines can live in one process)."""

    def __init__(self, rank: int, size: int, store, backend: str, device: str, timeout_s: float = 600.0):
        import torch.distributed as dist

        self.rank, self.size, self.backend = rank, size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            cls = getattr(dist, f"ProcessGroup{backend.upper()}", None)
            if cls is None:
                raise RuntimeError(f"torch.distributed has no {backend} process group in this build")
            self.group = cls(store, rank, size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (on a contiguous tensor; a strided one is copied and back)."""
        c = t if t.is_contiguous() else t.contiguous()
        self.group.allreduce([c]).wait()
        if c is not t:
            t.copy_(c)
        return t

    def gather_last(self, t: torch.Tensor, full: int) -> torch.Tensor:
        """The ranks' slices along the last dim, concatenated and cut to ``full`` columns."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)[..., :full]


@dataclass(frozen=True)
class Shard:
    """The slice of a module that this rank holds: ``kind`` column (output features), row (input
    features) or vocab (embedding rows); [start, end) of ``full`` along that dim."""

    kind: str
    rank: int
    size: int
    start: int
    end: int
    full: int

    @classmethod
    def even(cls, kind: str, full: int, rank: int, size: int, unit: int = 1) -> "Shard":
        """Equal slices of whole ``unit``s (a head's dims); the last may be shorter (vocab)."""
        units = -(-full // unit)
        per = -(-units // size) * unit
        start = min(rank * per, full)
        return cls(kind, rank, size, start, min(start + per, full), full)

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def padded(self) -> int:
        """Every rank's slice padded to the widest (what an all-gather needs)."""
        return -(-self.full // self.size)


def split_evenly(what: str, n: int, size: int) -> int:
    if n % size:
        from lora_conformance.engines.base import UnsupportedFeatureError

        raise UnsupportedFeatureError(f"tensor_parallel_size={size} does not divide the model's {what} ({n})")
    return n // size


def check_shardable(spec, size: int) -> None:
    """UnsupportedFeatureError where this engine cannot shard ``spec``'s model over ``size`` ranks."""
    from lora_conformance.engines.base import UnsupportedFeatureError

    if spec.kind == "encoder":
        raise UnsupportedFeatureError(f"tensor_parallel_size={size}: the builtin engine shards decoders only "
                                      f"({spec.model_type} is an encoder)")
    split_evenly("attention heads", spec.num_heads, size)
    split_evenly("key/value heads", spec.num_kv_heads, size)
    split_evenly("vocabulary", spec.vocab_size, size)
    if any(not spec.is_moe_layer(i) for i in range(spec.num_layers)):
        split_evenly("MLP intermediate size", spec.intermediate_size, size)


class RowParallelGroup(LinearGroup):
    """A single-module group whose input features are split over the ranks (o_proj, down_proj).

    ``add_to``: out += all_reduce(x_r W_r^T + expand(all_reduce(shrink_r(x_r)))) + bias, where
    only rank 0's expand pool holds B (the others hold zeros: engine/sharding.py), so the delta
    and its scaling count once. The shrink is masked to each row's own slot on every kind of
    batch (segments need no other treatment here: the masked result is the same sum)."""

    def __init__(self, parts, tp: TensorParallel):
        super().__init__(parts)
        self.tp = tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        out = x2.new_zeros(x2.shape[0], self.N)
        return self.add_to(out, x2).view(*shape[:-1], self.N)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out2, x2 = out.view(-1, self.N), x.reshape(-1, self.in_features)
        wt, b = self._base()
        y = _mm(x2, wt, None)
        batch = self._batch()
        if batch is not None:
            self._delta_before_reduce(y, x2, batch)
        self.tp.all_reduce(y)
        if b is not None:
            y.add_(b)
        out2.add_(y)
        return out

    def _delta_before_reduce(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        dd = batch.delta_dtype
        A, Bt = self.A, self.Bt
        if dd is not None and x.dtype != dd:
            h = (x.to(dd) @ A.to(dd).t()) * batch.mask(self.R, 1).to(dd)
            self.tp.all_reduce(h)
            y.add_((h @ Bt.to(dd)).to(y.dtype), alpha=batch.times)
            return
        h = _mm(x, A.t(), None)
        h.mul_(batch.mask(self.R, 1))
        self.tp.all_reduce(h)
        _addmm_(y, h, Bt, batch.times)

    # the cat layout (expand inside the base GEMM) is a single-device path
    def cat_batch(self, rows: int) -> Optional[LoraBatch]:
        return None


class VocabParallelEmbedding(LoraEmbedding):
    """embed_tokens with this rank's slice of the vocabulary rows (and of the LoRA's A rows): a
    token outside the slice reads zeros; the rows and the LoRA shrink are each all-reduced (a sum
    with one non-zero term: the one-device values, bit for bit), and the expand runs on every rank."""

    def __init__(self, vocab: int, hidden: int, ctx: LoraContext, tp: TensorParallel):
        shard = Shard.even("vocab", vocab, tp.rank, tp.size)
        super().__init__(shard.width, hidden, ctx)
        self.shard, self.tp = shard, tp

    def _local(self, ids: torch.Tensor):
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.width)
        return torch.where(inside, local, torch.zeros_like(local)), inside.unsqueeze(-1)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        local, inside = self._local(ids)
        return self.tp.all_reduce(F.embedding(local, self.weight) * inside.to(self.weight.dtype))

    def _lora_rows(self, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local, inside = self._local(ids)
        return self.tp.all_reduce(self.lora_At[slots, local] * inside.to(self.lora_At.dtype))


def parallel_linear(n_in: int, n_out: int, bias: bool, ctx: LoraContext, tp: Optional[TensorParallel],
                    kind: str, unit: int = 1) -> LoraLinear:
    """A LoraLinear holding this rank's ``kind`` (column | row) slice, in whole ``unit``s (a
    head's dims); the whole module without tp."""
    if tp is None:
        return LoraLinear(n_in, n_out, bias, ctx)
    shard = Shard.even(kind, n_out if kind == "column" else n_in, tp.rank, tp.size, unit)
    m = LoraLinear(shard.width if kind == "row" else n_in, shard.width if kind == "column" else n_out, bias, ctx)
    m.shard = shard
    if kind == "row":
        RowParallelGroup([m], tp)
    return m


def full_features(module) -> tuple[int, int]:
    """(input, output) features of the checkpoint module a (possibly sharded) layer holds a slice
    of; an embedding's (vocabulary, hidden). What an adapter's factors are checked against."""
    shard = getattr(module, "shard", None)
    if hasattr(module, "num_embeddings"):
        return (shard.full if shard is not None else module.num_embeddings), module.embedding_dim
    n_in, n_out = module.in_features, module.out_features
    if shard is not None and shard.kind == "column":
        n_out = shard.full
    elif shard is not None and shard.kind == "row":
        n_in = shard.full
    return n_in, n_out
