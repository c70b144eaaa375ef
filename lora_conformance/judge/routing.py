"""Nearest-reference routing: in a mixed batch, each slot's output must be nearest its own adapter.

Every label in the batch (adapter names and ``BASE`` for rows with no adapter) has an
isolated reference output. Each slot must be strictly nearer its own label's reference
than any other label's — base slots count as references too, so an adapter leaking into a
base row (or a base row served for an adapter) is caught. The outputs must not all be
identical: a batch that ignores every adapter would otherwise pass.

The distance is the decode check's own measure on the steps where the two decodes saw the same
context (``output_distance``): the largest logprob difference on the ids both report while the
tokens agree, and at the first differing token how decided either side was (its logprob gap
between its own token and the other's). It is the smallest decode and tie bound at which the
tie-aware decode check would accept the output as that reference's. After a divergence the two
continuations are conditioned on different text, so nothing there is compared: a correct engine
that breaks a near-tie the other way (bfloat16 rounding) is not pushed towards another adapter by
whatever its continuation happens to share with that adapter's. (The seed's distance, 1 - ROUGE-L
over the whole decode then the mean logprob difference, did exactly that: 30 of 660 bfloat16 null
runs of the default built-in engine failed it, and every benign rewriting alike; this distance, 0 of
4,116 bfloat16 and 648 float16 null runs, with every routing fault caught: docs/false-alarms-and-power.md.)
ROUGE-L is still shown beside each distance, for the reader.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.rouge import rouge_l
from lora_conformance.types import GenerationResult

BASE = "__base__"
_MISSING_PENALTY = 10.0


class IndistinctReferencesError(ValueError):
    """Two labels' references are identical: routing between them cannot be tested."""


def output_distance(actual: GenerationResult, reference: GenerationResult) -> float:
    """The decode distance of ``actual`` from ``reference`` on their context-aligned steps (see the
    module doc): the largest |logprob difference| on the ids both report at every step up to and
    including the first differing token, and at that token the larger of the reference's gap
    (its token's logprob minus the other's) and the output's (the same from its side). A token
    outside a side's top-k counts at least that side's top-1 minus its last reported logprob."""
    n = min(len(actual.token_ids), len(reference.token_ids))
    worst = 0.0
    for step in range(n):
        a_lp = actual.logprobs[step] if step < len(actual.logprobs) else {}
        r_lp = reference.logprobs[step] if step < len(reference.logprobs) else {}
        common = a_lp.keys() & r_lp.keys()
        if common:
            worst = max(worst, max(abs(a_lp[t] - r_lp[t]) for t in common))
        a_tok, r_tok = actual.token_ids[step], reference.token_ids[step]
        if a_tok != r_tok:
            return max(worst, _gap(r_lp, r_tok, a_tok), _gap(a_lp, a_tok, r_tok))
    if len(actual.token_ids) != len(reference.token_ids):
        return max(worst, _MISSING_PENALTY)  # one stopped where the other went on
    return worst


def _gap(topk: dict, own: int, other: int) -> float:
    """How decided a side was for its ``own`` token over ``other`` (a lower bound where ``other``
    is outside its top-k)."""
    if own not in topk:
        return _MISSING_PENALTY
    return topk[own] - topk.get(other, min(topk.values()))


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
    from lora_conformance.judge.logprobs import missing_decode_logprobs

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
            "distances": {n: {"decode": d, "rouge_l": rouge_l(out.token_ids, references[n].token_ids)}
                          for n, d in dists.items()},
            "text": " ".join(show(t) for t in out.token_ids),
        })
        if not strictly and best == own:  # a tie: as near another reference as its own
            tied = ", ".join(repr(n) for n in others if dists[n] <= dists[own])
            problems.append(f"slot {slot} expected {own!r} but is as near {tied} (distance {dists[own]:.3f})")
        elif not strictly:
            problems.append(f"slot {slot} expected {own!r} but is nearest {best!r}")
    distinct_labels = len(set(labels)) > 1
    all_same = len({tuple(o.token_ids) for o in outputs}) == 1 and len(outputs) > 1
    if distinct_labels and all_same:
        problems.append("all outputs are identical although the batch mixes different adapters")
    if problems:
        lines = [f"{label + ': ' if label else ''}routing failed: " + "; ".join(problems)]
        for r in rows:
            d = ", ".join(f"{n}={v['decode']:.3f} (ROUGE-L {v['rouge_l']:.2f})" for n, v in sorted(r["distances"].items()))
            lines.append(f"  slot {r['slot']:>2} expected {r['expected']:<10} nearest {r['nearest']:<10} "
                         f"{'ok ' if r['ok'] else 'BAD'} [{d}] {r['text'][:60]!r}")
        raise ConformanceAssertionError(
            "\n".join(lines),
            {"check": "nearest_reference_routing", "label": label, "summary": "; ".join(problems), "rows": rows},
        )
    return nearest
