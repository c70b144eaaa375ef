"""KV blocks: allocation per sequence, and the prefix cache (hash of full blocks).

A block's hash chains the previous block's hash, the adapter *identity* (content hash,
so two names for the same weights share and a reloaded name does not) and the block's
tokens. Only blocks filled by a prefill are published, and a sequence always recomputes
at least its last prompt token, so a hit never skips the logits it needs. Block 0 is a
scratch block (padding rows of captured graphs write there) and is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import deque

from lora_conformance.engines.builtin.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool, salt: str = "identity"):
        # salt: what keys a block's adapter: its identity (correct), its name or nothing (faults)
        self.block_size, self.prefix_cache, self.salt = block_size, prefix_cache, salt
        self.free: deque[int] = deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, str] = {}
        self.block_of: dict[str, int] = {}
        self.hits = 0  # blocks served from the cache (for tests and the report)

    def _hash(self, prev: str, seq: Sequence, i: int) -> str:
        if self.salt == "none":
            salt = ""
        elif self.salt == "name":  # the name outlives the weights it named
            salt = f"name:{seq.adapter}" if seq.adapter is not None else "base"
        else:
            salt = seq.identity
        toks = seq.tokens[i * self.block_size:(i + 1) * self.block_size]
        return hashlib.sha256(f"{prev}|{salt}|{toks}".encode()).hexdigest()

    def blocks_needed(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.prefix_cache or seq.want_prompt_logprobs and seq.prompt_logprobs is None:
            return []  # prompt logprobs need the logits of every prompt position
        out, prev = [], ""
        for i in range((len(seq) - 1) // self.block_size):
            prev = self._hash(prev, seq, i)
            b = self.block_of.get(prev)
            if b is None:
                break
            out.append(b)
        return out

    def can_allocate(self, seq: Sequence) -> bool:
        cached = self._cached_prefix(seq)
        reusable_free = sum(1 for b in cached if self.ref[b] == 0)
        return self.blocks_needed(len(seq)) - len(cached) + reusable_free <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        cached = self._cached_prefix(seq)
        for b in cached:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        self.hits += len(cached)
        table = list(cached)
        for _ in range(self.blocks_needed(len(seq)) - len(cached)):
            table.append(self._take())
        seq.block_table = table
        seq.num_cached = seq.num_computed = len(cached) * self.block_size
        seq.cached_reported = max(seq.cached_reported, seq.num_cached)

    def _take(self) -> int:
        b = self.free.popleft()
        h = self.hash_of.pop(b, None)
        if h is not None and self.block_of.get(h) == b:
            del self.block_of[h]
        self.ref[b] = 1
        return b

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or bool(self.free)

    def append(self, seq: Sequence) -> None:
        """Make room for the token that the next decode step writes (at position len-1)."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take())

    def publish_prompt(self, seq: Sequence) -> None:
        """After a prefill: make the sequence's full prompt blocks findable."""
        if not self.prefix_cache:
            return
        prev = ""
        for i in range(min(len(seq.prompt_ids), seq.num_computed) // self.block_size):
            prev = self._hash(prev, seq, i)
            b = seq.block_table[i]
            if prev not in self.block_of:
                self.block_of[prev] = b
                self.hash_of[b] = prev

    def release(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)  # keeps its hash until reused: a later request may hit it
        seq.block_table = []
        seq.num_cached = seq.num_computed = 0
