"""One request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class Sequence:
    prompt_ids: list[int]
    adapter: Optional[str]
    identity: str  # adapter content hash ("base" for none): the prefix-cache salt
    max_new_tokens: int
    top_k: int
    want_prompt_logprobs: bool
    ignore_eos: bool
    index: int = 0  # position in the caller's request list
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: Optional[list[dict[int, float]]] = None
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV was found in the prefix cache at admission
    cached_reported: int = 0  # the most prompt tokens ever served from the prefix cache (kept after release)
    num_computed: int = 0  # tokens whose KV is in the cache
    slot: int = -1  # device adapter slot, -1 = base
    chunk_end: int = 0  # the prefill step computes tokens [num_computed, chunk_end)
    prefilled: bool = False  # the whole prefill is done: the sequence decodes
    prompt_rows: list[dict[int, float]] = field(default_factory=list)  # prompt logprobs of the chunks so far

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens
