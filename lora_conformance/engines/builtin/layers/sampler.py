"""Greedy sampling and top-k logprobs, in float32."""

from __future__ import annotations

import torch


def greedy_with_topk(logits: torch.Tensor, k: int):
    """logits (N, V) -> (token ids (N,), topk ids (N, k), topk logprobs (N, k)), on device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = torch.topk(logprobs, max(k, 1), dim=-1)
    return top_ids[:, 0], top_ids, top_lp
