"""Greedy stability measurements shared by bench/model_margins.py and the tests.

A greedy step is stable when its fp32 top-1/top-2 logprob gap (the margin) is larger than
what bf16/fp16 rounding can move it by; these helpers measure margins and divergences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedyRun:
    tokens: torch.Tensor  # (prompts, steps)
    margins: torch.Tensor  # (prompts, steps) fp32-computed top-1/top-2 logprob gap


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], steps: int = 16, dtype=torch.float32) -> GreedyRun:
    """Batched greedy decoding (left padding, full recompute: simple and exact)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    model.to(dtype)
    toks, margins = [], []
    try:
        for _ in range(steps):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
            top = logits.log_softmax(-1).topk(2, dim=-1)
            nxt = top.indices[:, 0]
            toks.append(nxt)
            margins.append(top.values[:, 0] - top.values[:, 1])
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(nxt[:, None])], 1)
    finally:
        model.to(torch.float32)
    return GreedyRun(torch.stack(toks, 1), torch.stack(margins, 1))


def diverged(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Indices of prompts whose token sequences differ."""
    return [i for i in range(a.shape[0]) if not torch.equal(a[i], b[i])]


def first_change(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per prompt, the first step where the sequences differ (steps if never)."""
    out = []
    for i in range(a.shape[0]):
        diff = (a[i] != b[i]).nonzero()
        out.append(int(diff[0]) if len(diff) else a.shape[1])
    return out


def peft_with_adapter(base_dir, adapter_dir):
    from peft import PeftModel

    from lora_conformance.models import load_model

    return PeftModel.from_pretrained(load_model(base_dir), str(adapter_dir)).eval()
