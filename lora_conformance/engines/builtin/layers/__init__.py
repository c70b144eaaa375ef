"""One small module per layer kind: LoRA-aware linear and embedding, attention, rotary, norms, sampler."""

from __future__ import annotations

from typing import Callable

import torch


def into(out: torch.Tensor, op: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``op(*args, out=out)``; under torch.compile ``out.copy_(op(*args))``. An ``out=`` into a view
    (the layers write into slices of shared buffers) is a graph break in dynamo, and the frame resumed
    after it takes those buffers and their views as aliased inputs, which AOT autograd merges into a
    synthetic base that inductor failed to compile with dynamic shapes (torch 2.11 on an H200 and
    2.13 on cpu: "Expected !size_bytes_is_heap_allocated_"). Eager keeps the one-pass ``out=``."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args))
    return op(*args, out=out)
