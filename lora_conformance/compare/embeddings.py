"""Embedding comparisons (cosine), for encoder engines."""

from __future__ import annotations

import math
from typing import Sequence

from lora_conformance.compare.errors import ConformanceAssertionError


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
