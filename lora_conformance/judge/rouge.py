"""ROUGE-L F1 over an LCS: of words on text (rouge-score's tokenisation), of ids when ids are given.

Text is tokenised as rouge-score's ``RougeScorer(["rougeL"], use_stemmer=False)`` does (lower
case, every run of characters outside a-z and 0-9 a separator), so scores equal rouge-score's
(``tests/test_compare.py`` checks it against rouge-score where that is installed) without
importing it and nltk in every process (about 1.3 s each, paid again by every pytest-xdist worker).
"""

from __future__ import annotations

import re
from typing import Sequence

from lora_conformance.judge.errors import ConformanceAssertionError


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


_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def rouge_tokens(text: str) -> list[str]:
    """rouge-score's default tokeniser without stemming."""
    return _NON_ALNUM.sub(" ", text.lower()).split()


def rouge_l(actual: "str | Sequence[int]", reference: "str | Sequence[int]") -> float:
    """ROUGE-L F1 of words (strings) or of ids (id sequences). Two blank strings score 1; a
    string with no word against any other scores 0 (as rouge-score)."""
    if isinstance(actual, str) and isinstance(reference, str):
        if not actual.strip() and not reference.strip():
            return 1.0
        a, r = rouge_tokens(actual), rouge_tokens(reference)
        if not a or not r:
            return 0.0
        return _f1(lcs_length(a, r), len(a), len(r))
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
