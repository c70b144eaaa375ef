"""Nearest-reference routing: in a mixed batch, each slot's output must be nearest its own adapter.

Every label in the batch (adapter names and ``BASE`` for rows with no adapter) has an
isolated reference output. Each slot must be strictly nearer its own label's reference
than any other label's — base slots count as references too, so an adapter leaking into a
base row (or a base row served for an adapter) is caught. The outputs must not all be
identical: a batch that ignores every adapter would otherwise pass.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from lora_conformance.compare.errors import ConformanceAssertionError
from lora_conformance.compare.rouge import rouge_l
from lora_conformance.types import GenerationResult

BASE = "__base__"
_MISSING_PENALTY = 10.0


class IndistinctReferencesError(ValueError):
    """Two labels' references are identical: routing between them cannot be tested."""


def output_distance(actual: GenerationResult, reference: GenerationResult) -> tuple[float, float]:
    """(1 - ROUGE-L over token ids, mean |logprob diff| of the reference's tokens). Compared lexicographically."""
    token_d = 1.0 - rouge_l(actual.token_ids, reference.token_ids)
    diffs = []
    for i, r_tok in enumerate(reference.token_ids):
        a_lp = actual.logprobs[i] if i < len(actual.logprobs) else {}
        r_lp = reference.logprobs[i] if i < len(reference.logprobs) else {}
        if r_tok in a_lp and r_tok in r_lp:
            diffs.append(abs(a_lp[r_tok] - r_lp[r_tok]))
        else:
            diffs.append(_MISSING_PENALTY)
    return token_d, (sum(diffs) / len(diffs) if diffs else 0.0)


def assert_nearest_reference_routing(
    outputs: Sequence[GenerationResult],
    labels: Sequence[Optional[str]],
    references: Mapping[str, GenerationResult],
    *,
    decode: Optional[Callable[[int], str]] = None,
    label: str = "",
) -> list[str]:
    """Check routing; returns the label each slot was nearest to. ``None`` in ``labels`` means base."""
    if len(outputs) != len(labels):
        raise ValueError(f"{len(outputs)} outputs for {len(labels)} labels")
    labels = [BASE if l is None else l for l in labels]
    from lora_conformance.compare.logprobs import missing_decode_logprobs

    for i, out in enumerate(outputs):  # nearest-reference distances are computed from the logprobs
        missing = missing_decode_logprobs(out)
        if missing:
            raise ConformanceAssertionError(f"{label + ': ' if label else ''}slot {i}: {missing}",
                                            {"check": "nearest_reference_routing", "label": label,
                                             "summary": "no decode logprobs", "slot": i})
    missing = sorted(set(labels) - set(references))
    if missing:
        raise ValueError(f"no isolated reference for {missing}")
    names = sorted(references)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if references[a].token_ids == references[b].token_ids:
                raise IndistinctReferencesError(
                    f"references {a!r} and {b!r} are identical ({len(references[a].token_ids)} tokens): "
                    "the adapters are not distinguishable on this prompt, so routing cannot be checked"
                )
    show = decode or str
    rows, nearest, problems = [], [], []
    for slot, (out, own) in enumerate(zip(outputs, labels)):
        dists = {name: output_distance(out, ref) for name, ref in references.items()}
        best = min(dists, key=lambda n: (dists[n], n != own))
        others = [n for n in dists if n != own]
        strictly = all(dists[own] < dists[n] for n in others)
        nearest.append(best)
        rows.append({
            "slot": slot, "expected": own, "nearest": best, "ok": strictly,
            "distances": {n: {"token": d[0], "logprob": d[1]} for n, d in dists.items()},
            "text": " ".join(show(t) for t in out.token_ids),
        })
        if not strictly:
            problems.append(f"slot {slot} expected {own!r} but is nearest {best!r}")
    distinct_labels = len(set(labels)) > 1
    all_same = len({tuple(o.token_ids) for o in outputs}) == 1 and len(outputs) > 1
    if distinct_labels and all_same:
        problems.append("all outputs are identical although the batch mixes different adapters")
    if problems:
        lines = [f"{label + ': ' if label else ''}routing failed: " + "; ".join(problems)]
        for r in rows:
            d = ", ".join(f"{n}={v['token']:.2f}/{v['logprob']:.3f}" for n, v in sorted(r["distances"].items()))
            lines.append(f"  slot {r['slot']:>2} expected {r['expected']:<10} nearest {r['nearest']:<10} "
                         f"{'ok ' if r['ok'] else 'BAD'} [{d}] {r['text'][:60]!r}")
        raise ConformanceAssertionError(
            "\n".join(lines),
            {"check": "nearest_reference_routing", "label": label, "summary": "; ".join(problems), "rows": rows},
        )
    return nearest
