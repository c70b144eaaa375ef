"""ROUGE-L: rouge-score on text, or an LCS over token ids when ids are given."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from lora_conformance.compare.errors import ConformanceAssertionError


def lcs_length(a: Sequence, b: Sequence) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _f1(lcs: int, n_a: int, n_b: int) -> float:
    if n_a == 0 and n_b == 0:
        return 1.0
    if lcs == 0:
        return 0.0
    p, r = lcs / n_a, lcs / n_b
    return 2 * p * r / (p + r)


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(actual: "str | Sequence[int]", reference: "str | Sequence[int]") -> float:
    """ROUGE-L F1. Strings go through rouge-score; id sequences through an exact LCS."""
    if isinstance(actual, str) and isinstance(reference, str):
        if not actual.strip() and not reference.strip():
            return 1.0
        return float(_scorer().score(reference, actual)["rougeL"].fmeasure)
    if isinstance(actual, str) or isinstance(reference, str):
        raise TypeError("rouge_l compares two strings or two token-id sequences, not a mix")
    return _f1(lcs_length(actual, reference), len(actual), len(reference))


def assert_rouge_l(actual: str, reference: str, threshold: float, *, label: str = "") -> float:
    score = rouge_l(actual, reference)
    if score < threshold:
        raise ConformanceAssertionError(
            f"{label + ': ' if label else ''}ROUGE-L {score:.3f} < {threshold:.3f}\n"
            f"  actual:    {actual!r}\n  reference: {reference!r}",
            {"check": "rouge_l", "summary": f"ROUGE-L {score:.3f} < {threshold:.3f}", "label": label,
             "score": score, "threshold": threshold, "actual": actual, "reference": reference},
        )
    return score
