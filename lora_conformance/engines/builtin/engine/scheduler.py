"""Continuous batching: admit waiting sequences for prefill while KV blocks, adapter slots and
batch room last; otherwise run one decode step for everything running. Never touches tensors.

With a prefill chunk size C, one prefill step computes at most C prompt tokens: a longer prompt
is admitted with its first C tokens (blocks and slot for the whole sequence) and stays in
``running`` unprefilled; its next chunk comes first in the next prefill step. Chunks of several
sequences share a step, so adapters change inside a chunk and at chunk boundaries. A sequence
decodes only once its whole prefill is done, and decode waits while any chunk is pending.

A waiting request whose adapter cannot get a slot (all slots held by adapters of running
requests, or pinned) waits and the others are admitted around it, so batches split.
Decode preempts the newest sequence (recomputed later) when KV blocks run out.
"""

from __future__ import annotations

from collections import deque

from lora_conformance.engines.base import EngineFailure
from lora_conformance.engines.builtin.engine.adapter_pool import AdapterPool
from lora_conformance.engines.builtin.engine.block_manager import BlockManager
from lora_conformance.engines.builtin.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, pool: AdapterPool, max_batch_size: int, max_batch_tokens: int,
                 chunk_size: int = 0):
        self.blocks, self.pool = blocks, pool
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.chunk_size = chunk_size  # 0: a prompt's prefill is one step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _locked(self, batch: list[Sequence]) -> set[str]:
        return {s.adapter for s in self.running + batch if s.adapter is not None}

    def _chunk(self, seq: Sequence, tokens: int) -> int:
        """Tokens of ``seq``'s prefill this step computes, ``tokens`` of the step's budget spent."""
        left = len(seq) - seq.num_computed
        return left if not self.chunk_size else min(left, self.chunk_size - tokens)

    def schedule(self) -> tuple[list[Sequence], bool]:
        batch: list[Sequence] = []
        tokens = 0
        for seq in self.running:  # unfinished chunked prefills first: they hold blocks and a slot
            if seq.prefilled:
                continue
            n = self._chunk(seq, tokens)
            if n <= 0:
                break
            seq.chunk_end = seq.num_computed + n
            batch.append(seq)
            tokens += n
        continuing = len(batch)
        for seq in list(self.waiting):
            if len(self.running) + len(batch) - continuing >= self.max_batch_size:
                break
            if self.chunk_size and tokens >= self.chunk_size:
                break
            if not self.chunk_size and batch and tokens + len(seq) > self.max_batch_tokens:
                break
            locked = self._locked(batch)
            if seq.adapter is not None and not self.pool.can_assign(seq.adapter, locked):
                continue  # waits for a slot; later requests may still fit
            if not self.blocks.can_allocate(seq):
                continue
            seq.slot = -1 if seq.adapter is None else self.pool.assign(seq.adapter, locked)
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            seq.prefilled = False
            seq.prompt_rows = []
            n = self._chunk(seq, tokens)
            seq.chunk_end = seq.num_computed + n
            self.waiting.remove(seq)
            batch.append(seq)
            tokens += n
        if batch:
            self.running.extend(batch[continuing:])
            return batch, True
        if not self.running:
            if self.waiting:
                s = self.waiting[0]
                raise EngineFailure(
                    f"request of {len(s)} tokens can never be scheduled: not enough KV blocks "
                    f"({len(self.blocks.free)} free of block size {self.blocks.block_size}) or adapter slots"
                )
            return [], False
        for seq in list(self.running):
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.append(seq)
        return list(self.running), False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.blocks.release(seq)
