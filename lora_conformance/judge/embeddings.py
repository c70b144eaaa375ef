"""Embedding comparisons (cosine), for encoder engines."""

from __future__ import annotations

import math
from typing import Sequence

from lora_conformance.judge.errors import ConformanceAssertionError


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"embedding sizes differ: {len(a)} vs {len(b)}")
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    if na == 0 or nb == 0:
        return 0.0
    return dot / (na * nb)


def norm(a: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in a))


def assert_embeddings_close(actual: Sequence[Sequence[float]], reference: Sequence[Sequence[float]],
                            min_cosine: float, *, label: str = "") -> list[float]:
    if len(actual) != len(reference):
        raise ConformanceAssertionError(
            f"{label + ': ' if label else ''}{len(actual)} embeddings for {len(reference)} references",
            {"check": "embeddings_close", "label": label, "summary": "count mismatch"})
    cosines = [cosine(a, r) for a, r in zip(actual, reference)]
    bad = [(i, c) for i, c in enumerate(cosines) if not c >= min_cosine]
    if bad:
        detail = ", ".join(f"#{i}: {c:.5f}" for i, c in bad)
        raise ConformanceAssertionError(
            f"{label + ': ' if label else ''}cosine to reference below {min_cosine}: {detail}",
            {"check": "embeddings_close", "label": label, "summary": f"cosine below {min_cosine}: {detail}",
             "cosines": cosines, "min_cosine": min_cosine})
    return cosines


def _diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> list[list[float]]:
    return [[x - y for x, y in zip(u, v)] for u, v in zip(a, b)]


def _sq(v: Sequence[float]) -> float:
    return math.fsum(x * x for x in v)


def assert_embedding_effects_close(engine_adapted: Sequence[Sequence[float]], engine_base: Sequence[Sequence[float]],
                                   reference_effects: dict[str, Sequence[Sequence[float]]], own: str,
                                   rel_max: float, slope_margin: float, *, label: str = "") -> dict:
    """The adapter-induced change, not the raw vector: the engine's (adapted minus base, both from the
    engine) against the reference's, pooled over the texts. Raw cosine cannot tell adapters apart
    (base-to-adapted cosine is about 0.995); the change can. Checks: pooled relative residual
    ``||dE - dR|| / ||dR||`` <= ``rel_max``; effective scale ``<dE, dR> / ||dR||^2`` within 1 ±
    ``slope_margin``; each text's change nearest its own adapter's among ``reference_effects``
    (a routing check). ``reference_effects`` maps adapter names to the reference's changes."""
    dE, dR = _diff(engine_adapted, engine_base), reference_effects[own]
    rr = math.fsum(_sq(v) for v in dR)
    rel = math.sqrt(math.fsum(_sq([x - y for x, y in zip(u, v)]) for u, v in zip(dE, dR)) / rr)
    slope = math.fsum(math.fsum(x * y for x, y in zip(u, v)) for u, v in zip(dE, dR)) / rr
    nearest = []
    for i, e in enumerate(dE):
        dist = {n: math.sqrt(_sq([x - y for x, y in zip(e, eff[i])])) for n, eff in reference_effects.items()}
        dist["base (no adapter)"] = math.sqrt(_sq(e))
        nearest.append(min(dist, key=dist.get))
    evidence = {"check": "embedding_effects", "label": label, "relative_residual": rel, "slope": slope,
                "nearest": nearest, "rel_max": rel_max, "slope_margin": slope_margin}
    problems = []
    wrong = [(i, n) for i, n in enumerate(nearest) if n != own]
    if wrong:
        problems.append("texts nearer another hypothesis than their adapter's: " +
                        ", ".join(f"#{i} -> {n}" for i, n in wrong))
        evidence["hypothesis"] = {"nearest": wrong[0][1], "adapter": own}
    if rel > rel_max:
        problems.append(f"adapter-induced change differs from the reference's by {rel:.3g} of its size > {rel_max:g}")
    if abs(slope - 1) > slope_margin:
        problems.append(f"effective scale {slope:.4f} outside 1 ± {slope_margin:g}")
    if problems:
        raise ConformanceAssertionError(f"{label + ': ' if label else ''}" + "; ".join(problems),
                                        {**evidence, "summary": problems[0]})
    return evidence
