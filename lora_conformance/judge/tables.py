"""Side-by-side token tables for failure messages and report evidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lora_conformance.types import GenerationResult, TopK


@dataclass
class Table:
    rows: list[dict]
    text: str


def _margin(topk: TopK) -> Optional[float]:
    vals = sorted(topk.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else None


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def token_table(actual: GenerationResult, reference: GenerationResult, *,
                decode: Optional[Callable[[int], str]] = None, mark_step: Optional[int] = None,
                max_rows: int = 32) -> Table:
    """One row per step: reference token, logprob and top-1/top-2 margin beside the engine's."""
    show = decode or (lambda t: str(t))
    n = max(len(actual.token_ids), len(reference.token_ids))
    rows: list[dict] = []
    lines = [f"{'step':>4}  {'reference':<16} {'ref lp':>9} {'margin':>8} | {'engine':<16} {'eng lp':>9} {'diff':>9}"]
    for i in range(min(n, max_rows)):
        r_tok = reference.token_ids[i] if i < len(reference.token_ids) else None
        a_tok = actual.token_ids[i] if i < len(actual.token_ids) else None
        r_lp = reference.logprobs[i] if i < len(reference.logprobs) else {}
        a_lp = actual.logprobs[i] if i < len(actual.logprobs) else {}
        r_val = r_lp.get(r_tok) if r_tok is not None else None
        a_val = a_lp.get(a_tok) if a_tok is not None else None
        # The engine's logprob of the reference's token: the number a tolerance is about.
        a_of_r = a_lp.get(r_tok) if r_tok is not None else None
        diff = None if (r_val is None or a_of_r is None) else a_of_r - r_val
        row = {
            "step": i,
            "reference_token": r_tok,
            "reference_text": None if r_tok is None else show(r_tok),
            "reference_logprob": r_val,
            "reference_margin": _margin(r_lp) if r_lp else None,
            "engine_token": a_tok,
            "engine_text": None if a_tok is None else show(a_tok),
            "engine_logprob": a_val,
            "diff": diff,
            "same": r_tok == a_tok,
        }
        rows.append(row)
        flag = "  " if row["same"] else "≠ "
        if mark_step == i:
            flag = "→ "
        lines.append(
            f"{flag}{i:>2}  {str(row['reference_text']):<16.16} {_fmt(r_val):>9} {_fmt(row['reference_margin']):>8} | "
            f"{str(row['engine_text']):<16.16} {_fmt(a_val):>9} {_fmt(diff):>9}"
        )
    if n > max_rows:
        lines.append(f"  ... {n - max_rows} more steps")
    return Table(rows=rows, text="\n".join(lines))
