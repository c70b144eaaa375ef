"""Is an engine still the engine it was? The health check run around every bad input.

A snapshot is the engine's adapter list plus its outputs (tokens and top-k logprobs, prompt
logprobs where asked) for the base model and every loaded adapter, one batch per adapter (and one
for the base): mixed-batch routing is certified by its own suites, and a routing bug (base rows
beside adapter rows getting a delta, say) must not read as "the refusal changed the engine". A
refused load must leave both exactly as they were: the same list, bit-identical outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from lora_conformance.types import GenerationRequest, GenerationResult

PROBE_PROMPTS = ("once upon a time there was a dragon who", "the king went to the castle and")


@dataclass
class Snapshot:
    adapters: list[str]
    requests: list[GenerationRequest]
    outputs: list[GenerationResult]


def probe_requests(adapters: Sequence[Optional[str]], prompts: Sequence[str] = PROBE_PROMPTS,
                   max_new_tokens: int = 4) -> list[GenerationRequest]:
    return [GenerationRequest(p, adapter=a, max_new_tokens=max_new_tokens, top_k=3)
            for a in adapters for p in prompts]


def snapshot(engine, prompts: Sequence[str] = PROBE_PROMPTS, max_new_tokens: int = 4) -> Snapshot:
    """The engine's state as the health check compares it. The probe batch runs once before it is
    recorded: serving an adapter for the first time may place it into a device slot, and a correct
    engine's base rows may then take another (equally exact) GEMM layout, which changes low bits
    (the builtin engine: base logprobs 5e-7 apart once any slot is occupied). That is the
    snapshot's own doing, not the refused input's."""
    names = sorted(engine.list_adapters())
    reqs = probe_requests([None, *names], prompts, max_new_tokens)
    generate_per_adapter(engine, reqs)
    return Snapshot(names, reqs, generate_per_adapter(engine, reqs))


def generate_per_adapter(engine, reqs: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """``reqs``' outputs in order, each adapter's (and the base's) requests as a batch of their own."""
    out: list[Optional[GenerationResult]] = [None] * len(reqs)
    for name in dict.fromkeys(r.adapter for r in reqs):
        idx = [i for i, r in enumerate(reqs) if r.adapter == name]
        for i, o in zip(idx, engine.generate([reqs[i] for i in idx])):
            out[i] = o
    return out  # type: ignore[return-value]


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """What changed, one line each (empty: healthy). Logprobs compare exactly (NaN never equals)."""
    out = []
    if after.adapters != before.adapters:
        out.append(f"adapter list: expected {before.adapters}, got {after.adapters}")
    for req, a, b in zip(before.requests, before.outputs, after.outputs):
        who = f"{req.adapter or 'base'} / {req.prompt!r}"
        if a.token_ids != b.token_ids:
            out.append(f"{who}: tokens expected {a.token_ids}, got {b.token_ids}")
            continue
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if x != y or any(math.isnan(v) for v in y.values()):
                out.append(f"{who}: step {step} top-k expected {x}, got {y}")
                break
    return out


def assert_healthy(engine, before: Snapshot, what: str) -> None:
    """Re-run the snapshot's batch on ``engine``; fail naming everything that changed."""
    names = sorted(engine.list_adapters())
    # With another adapter list the batch may name an adapter that is gone: report the list alone.
    outputs = generate_per_adapter(engine, before.requests) if names == before.adapters else []
    problems = differences(before, Snapshot(names, before.requests, outputs))
    if problems:
        raise AssertionError(f"engine state changed after {what}:\n  " + "\n  ".join(problems[:10]))
