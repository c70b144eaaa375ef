"""Plain data that crosses every boundary: suite -> engine -> comparison -> report.

No torch here: these records are built by engines, cached by the reference runner,
serialised into reports and shipped between pytest-xdist workers, so they hold only
Python numbers, strings and lists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

# Per-position top-k logprobs: token id -> logprob. JSON turns int keys into strings,
# so (de)serialisation goes through ``_topk_to_json`` / ``_topk_from_json``.
TopK = dict[int, float]


@dataclass(frozen=True)
class GenerationRequest:
    """One greedy generation. ``adapter`` is a loaded adapter's name, or None for the base model."""

    prompt: str
    adapter: Optional[str] = None
    max_new_tokens: int = 16
    top_k: int = 5
    prompt_logprobs: bool = False
    # Greedy until max_new_tokens: conformance compares fixed-length continuations, so EOS
    # does not stop generation unless the caller asks for it.
    ignore_eos: bool = True


@dataclass
class GenerationResult:
    """What an engine (or the reference) produced for one request."""

    token_ids: list[int]
    text: str
    # One entry per generated token: the top-k at that step (token id -> logprob).
    logprobs: list[TopK] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    # One entry per prompt position after the first (the distribution that predicted it),
    # or None when not requested / not supported.
    prompt_logprobs: Optional[list[TopK]] = None
    # Prompt tokens whose KV came from a prefix cache, as the engine reports it; None: the engine
    # cannot say (a prefix-cache test then cannot prove that a hit happened, and says so).
    cached_tokens: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["logprobs"] = [_topk_to_json(t) for t in self.logprobs]
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [_topk_to_json(t) for t in self.prompt_logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationResult":
        pl = d.get("prompt_logprobs")
        return cls(
            token_ids=[int(t) for t in d["token_ids"]],
            text=d["text"],
            logprobs=[_topk_from_json(t) for t in d.get("logprobs", [])],
            prompt_token_ids=[int(t) for t in d.get("prompt_token_ids", [])],
            prompt_logprobs=None if pl is None else [_topk_from_json(t) for t in pl],
            cached_tokens=None if d.get("cached_tokens") is None else int(d["cached_tokens"]),
        )


def _topk_to_json(t: TopK) -> dict[str, float]:
    return {str(k): float(v) for k, v in t.items()}


def _topk_from_json(t: dict[str, float]) -> TopK:
    return {int(k): float(v) for k, v in t.items()}
