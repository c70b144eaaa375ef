"""What an engine declares: the fixed vocabulary of capabilities, and its limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Capability(str, enum.Enum):
    """The fixed vocabulary of engine capabilities (``@pytest.mark.requires(...)`` takes these values)."""

    MIXED_BATCH = "mixed_batch"  # different adapters (and the base) in one batch
    DYNAMIC_LOADING = "dynamic_loading"  # load/unload adapters after start-up
    PINNING = "pinning"
    EVICTION_LRU = "eviction_lru"
    EVICTION_FIFO = "eviction_fifo"
    MAX_LOADED = "max_loaded"  # a bounded host cache of loaded adapters (more adapters than slots)
    PREFIX_CACHE = "prefix_cache"
    OVERLAP_LOADING = "overlap_loading"
    GRAPHS = "graphs"
    EMBEDDINGS = "embeddings"
    MOE = "moe"
    RSLORA = "rslora"
    RANK_PATTERN = "rank_pattern"
    EMBED_TOKENS = "embed_tokens"
    LM_HEAD = "lm_head"
    DORA = "dora"
    MODULES_TO_SAVE = "modules_to_save"
    PROMPT_LOGPROBS = "prompt_logprobs"
    LORA_BIAS = "lora_bias"
    TENSOR_PARALLEL = "tensor_parallel"  # shards the model (and its LoRA) over several devices
    CHUNKED_PREFILL = "chunked_prefill"  # honours the standard arg chunked_prefill_size
    INFLIGHT_LIFECYCLE = "inflight_lifecycle"  # submit(); load / unload / reload while requests run

    @classmethod
    def parse(cls, value: "str | Capability") -> "Capability":
        if isinstance(value, Capability):
            return value
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown engine capability {value!r}; known capabilities: {known}") from None


ALL_CAPABILITIES: frozenset[Capability] = frozenset(Capability)


@dataclass(frozen=True)
class Limits:
    max_loras_per_batch: int  # adapters (not counting the base) active in one forward
    max_loaded_loras: int  # adapters held by the engine at once (>= max_loras_per_batch)
    max_rank: int
    max_top_k: Optional[int] = None  # logprobs returned per generated token (None: as many as asked)
