"""Token and logprob agreement between an engine's output and the reference's.

Decode: step by step while the tokens agree, every top-k id that both sides report must
have logprobs within the dtype's ``decode_atol``. At the first differing token each side's
token must be in the other's top-k (as vLLM's ``check_logprobs_close``) or be measured as
below, *and* the
reference must have been undecided there: its logprob gap between its own token and the
engine's token below the dtype's ``tie_margin``. Such a divergence is reported as a tie
and the comparison stops (after a tie the two continuations are conditioned on different
text). A divergence at a decisive step is a failure.

Where the reference's top-k leaves the engine's token out and the caller can score the
reference (``resolve``: the reference's logprobs of given ids at a step, teacher-forced on the
prompt and the tokens both sides chose before it), the reference's logprob of that token is
measured instead of assumed: at a flat step of a real-vocabulary model more than k tokens lie
within the tie margin, and a correct bfloat16 engine's choice among them can fall outside the
float32 reference's top 5 (the full profile's slot_saturation on the H200: reference margin
0.0003, its top token at -2.26). The measured logprob must then be within ``decode_atol`` of the
engine's and the reference's gap to it within ``tie_margin``; a token the reference puts further
away still fails. Where the reference's token is outside the engine's top-k (the same flat step on
the H200, seen again: neither token in the other's top 5), the engine is not asked, but its top-k
bounds it: a greedy engine gives every token it leaves out at most the lowest logprob it lists, so a
reference logprob more than ``decode_atol`` above that floor is a measured disagreement and fails;
within it, the reference's gap decides as above.

Prefill (prompt logprobs): pooled, not position by position. At each position the logprobs of
the ids both sides report are centred (minus their mean: a softmax normaliser cancels); the rms
of the centred differences over every position of the prompt (of every prompt of a check, with
``assert_prompt_logprobs_close``) must stay below the dtype's
``prompt_rms_max`` and no single point may exceed the gross bound ``free_running_atol`` (that of
the free-running decode). Both are calibrated on null runs of correct engines (``bench/power.py``);
the precise verdict on prompt logprobs is the paired one (``paired.run_prompt_logprobs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.tables import token_table
from lora_conformance.judge.tolerances import Tolerance, tolerance_for
from lora_conformance.types import GenerationResult, TopK

Decoder = Optional[Callable[[int], str]]


@dataclass
class Agreement:
    """What a passing comparison established (kept for reports and calibration)."""

    steps_compared: int
    tie_at: Optional[int] = None  # step of a tolerated divergence
    max_decode_diff: float = 0.0
    max_prefill_diff: float = 0.0  # worst centred prompt-logprob difference (a point)
    prefill_rms: float = 0.0  # rms of the centred prompt-logprob differences (pooled)
    notes: list[str] = field(default_factory=list)


def margin(topk: TopK) -> float:
    """Top-1 minus top-2 logprob (inf when only one entry is known)."""
    vals = sorted(topk.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else float("inf")


def _max_common_diff(a: TopK, b: TopK) -> tuple[float, Optional[int]]:
    worst, worst_id = 0.0, None
    for tid in a.keys() & b.keys():
        d = abs(a[tid] - b[tid])
        if d > worst:
            worst, worst_id = d, tid
    return worst, worst_id


def _fail(message: str, evidence: dict, actual: GenerationResult, reference: GenerationResult,
          decode: Decoder, mark: Optional[int]) -> ConformanceAssertionError:
    table = token_table(actual, reference, decode=decode, mark_step=mark)
    evidence = {**evidence, "rows": table.rows}
    return ConformanceAssertionError(f"{message}\n{table.text}", evidence)


def _scored(scored: Optional[TopK]) -> dict:
    """The evidence's ``scored`` (the reference's teacher-forced logprobs at a divergence), where asked."""
    return {"scored": {str(k): v for k, v in scored.items()}} if scored else {}


def _measured(agreement: "Agreement", tol: Tolerance, diff: float, note: str, message: str, evidence: dict,
              where: tuple) -> None:
    """A measured difference at a divergence: noted, and a failure (``message``, ``evidence`` with the
    diff) where it exceeds decode_atol; ``where`` is ``_fail``'s (actual, reference, decode, step)."""
    agreement.notes.append(note)
    if diff > tol.decode_atol:
        raise _fail(f"{message} > decode_atol {tol.decode_atol:g} ({tol.dtype})", {**evidence, "diff": diff}, *where)


def missing_decode_logprobs(result: GenerationResult) -> Optional[str]:
    """Why ``result`` lacks the decode logprobs a comparison needs (one top-k per generated
    token, none empty), or None. A check must never pass without the evidence it compares."""
    n = len(result.token_ids)
    have = sum(1 for lp in result.logprobs[:n] if lp)
    if have < n:
        return (f"the engine returned decode logprobs for {have} of {n} generated tokens; this check compares "
                "them, so it cannot pass without them (the engine must return top-k logprobs per token)")
    return None


def assert_logprobs_close(
    actual: GenerationResult,
    reference: GenerationResult,
    dtype: "str | Tolerance" = "float32",
    *,
    label: str = "",
    decode: Decoder = None,
    check_prompt: bool = True,
    min_steps: int = 1,
    resolve: Optional[Callable[[int, list[int]], Optional[TopK]]] = None,
) -> Agreement:
    """Raise ConformanceAssertionError unless ``actual`` agrees with ``reference`` (see module doc).
    ``resolve(step, ids)``: the reference's logprobs of ``ids`` at decode step ``step`` (None where it
    cannot say); asked only for an engine token outside the reference's top-k at the divergence."""
    tol = dtype if isinstance(dtype, Tolerance) else tolerance_for(dtype)
    prefix = f"{label}: " if label else ""
    base_ev = {"check": "logprobs_close", "label": label, "dtype": tol.dtype, "tolerance": tol.as_dict()}
    agreement = Agreement(steps_compared=0)

    if not actual.token_ids and reference.token_ids:
        raise _fail(f"{prefix}engine produced no tokens", {**base_ev, "summary": "no tokens"},
                    actual, reference, decode, None)
    missing = missing_decode_logprobs(actual) if reference.logprobs else None
    if missing:
        raise _fail(f"{prefix}{missing}", {**base_ev, "summary": "no decode logprobs"}, actual, reference, decode, None)

    if check_prompt:
        agreement.prefill_rms, agreement.max_prefill_diff = assert_prompt_logprobs_close(
            [actual], [reference], tol, labels=[label], decode=decode)

    n = min(len(actual.token_ids), len(reference.token_ids))
    for step in range(n):
        a_tok, r_tok = actual.token_ids[step], reference.token_ids[step]
        a_lp = actual.logprobs[step] if step < len(actual.logprobs) else {}
        r_lp = reference.logprobs[step] if step < len(reference.logprobs) else {}
        d, tid = _max_common_diff(a_lp, r_lp)
        agreement.max_decode_diff = max(agreement.max_decode_diff, d)
        if d > tol.decode_atol:
            raise _fail(
                f"{prefix}step {step}: logprob of token id {tid} differs by {d:.4g} > decode_atol "
                f"{tol.decode_atol:g} ({tol.dtype})",
                {**base_ev, "summary": f"decode diff {d:.4g} > {tol.decode_atol:g} at step {step}",
                 "step": step, "diff": d}, actual, reference, decode, step)
        if a_tok == r_tok:
            agreement.steps_compared = step + 1
            continue
        # First divergence: acceptable only as a genuine tie of the reference.
        scored = resolve(step, [r_tok, a_tok]) if a_tok not in r_lp and resolve else None
        if scored is not None and {r_tok, a_tok} <= scored.keys():
            # The reference's own logprobs of both tokens, teacher-forced on the shared prefix; its
            # top-k had left the engine's token out.
            d = abs(a_lp[a_tok] - scored[a_tok])
            agreement.max_decode_diff = max(agreement.max_decode_diff, d)
            _measured(agreement, tol, d, f"step {step}: engine token {a_tok} outside the reference's top-k; the "
                      f"reference scored it {scored[a_tok]:.4g} (its own token {scored[r_tok]:.4g})",
                      f"{prefix}step {step}: tokens diverge ({a_tok} vs reference {r_tok}); the engine token, outside "
                      f"the reference top-k, scored by the reference: logprob differs by {d:.4g}",
                      {**base_ev, "summary": f"decode diff {d:.4g} > {tol.decode_atol:g} at step {step} (scored)",
                       "step": step, **_scored(scored)}, (actual, reference, decode, step))
            r_lp = {**r_lp, r_tok: scored[r_tok], a_tok: scored[a_tok]}
        if a_tok not in r_lp:
            raise _fail(
                f"{prefix}step {step}: tokens diverge ({a_tok} vs reference {r_tok}) and the engine token is not in "
                "the reference top-k",
                {**base_ev, "summary": f"divergence at step {step} outside top-k", "step": step},
                actual, reference, decode, step)
        if r_tok not in a_lp:
            # The engine's top-k left the reference's token out: it gives that token at most the lowest
            # logprob it lists (its own token is its top), which a correct engine keeps within decode_atol
            # of the reference's.
            floor = min(a_lp.values())
            short = r_lp[r_tok] - floor
            _measured(agreement, tol, short, f"step {step}: reference token {r_tok} outside the engine's top-k; the "
                      f"engine gives it at most {floor:.4g}, the reference {r_lp[r_tok]:.4g}",
                      f"{prefix}step {step}: tokens diverge ({a_tok} vs reference {r_tok}); the reference token, "
                      f"outside the engine top-k, is at most {floor:.4g} there, {short:.4g} below the reference's "
                      f"{r_lp[r_tok]:.4g}",
                      {**base_ev, "summary": f"reference token {short:.4g} below the engine top-k at step {step}",
                       "step": step, "engine_floor": floor, **_scored(scored)}, (actual, reference, decode, step))
        gap = r_lp[r_tok] - r_lp[a_tok]
        if gap > tol.tie_margin:
            how = " (the engine token scored by the reference: outside its top-k)" if scored else ""
            raise _fail(
                f"{prefix}step {step}: tokens diverge ({a_tok} vs reference {r_tok}) where the reference "
                f"was decided (gap {gap:.4g} > tie_margin {tol.tie_margin:g}, {tol.dtype}){how}",
                {**base_ev, "summary": f"decisive divergence at step {step} (gap {gap:.4g})", "step": step,
                 "gap": gap, **_scored(scored)}, actual, reference, decode, step)
        agreement.tie_at = step
        agreement.notes.append(f"tie at step {step}: reference gap {gap:.4g} <= {tol.tie_margin:g}")
        break
    else:
        if len(actual.token_ids) != len(reference.token_ids):
            raise _fail(
                f"{prefix}engine produced {len(actual.token_ids)} tokens, reference {len(reference.token_ids)}",
                {**base_ev, "summary": "length mismatch"}, actual, reference, decode, n)

    if agreement.tie_at is None and agreement.steps_compared < min(min_steps, n):
        raise _fail(f"{prefix}only {agreement.steps_compared} steps compared (< {min_steps})",
                    {**base_ev, "summary": "too few steps compared"}, actual, reference, decode, None)
    return agreement


def assert_prompt_logprobs_close(actuals: Sequence[GenerationResult], references: Sequence[GenerationResult],
                                 dtype: "str | Tolerance" = "float32", *, labels: Sequence[str] = (),
                                 decode: Decoder = None) -> tuple[float, float]:
    """Prompt logprobs of several requests against their references, pooled (see the module doc):
    the rms of the centred differences over every position of every request below
    ``prompt_rms_max``, each point below ``free_running_atol``. Pairs without prompt logprobs on
    either side are left out. Returns (rms, worst point)."""
    tol = dtype if isinstance(dtype, Tolerance) else tolerance_for(dtype)
    labels = list(labels) + [""] * (len(actuals) - len(labels))
    base_ev = {"check": "logprobs_close", "dtype": tol.dtype, "tolerance": tol.as_dict()}
    sq, points, positions, worst, where = 0.0, 0, 0, 0.0, None
    for k, (actual, reference) in enumerate(zip(actuals, references)):
        if actual.prompt_logprobs is None or reference.prompt_logprobs is None:
            continue
        prefix = f"{labels[k]}: " if labels[k] else ""
        if len(actual.prompt_logprobs) != len(reference.prompt_logprobs):
            raise _fail(
                f"{prefix}prompt logprobs cover {len(actual.prompt_logprobs)} positions, reference "
                f"{len(reference.prompt_logprobs)} (prompt tokenised differently?)",
                {**base_ev, "label": labels[k], "summary": "prompt length mismatch"},
                actual, reference, decode, None)
        for pos, (a, r) in enumerate(zip(actual.prompt_logprobs, reference.prompt_logprobs)):
            common = sorted(a.keys() & r.keys())
            if not common:
                raise _fail(f"{prefix}prompt position {pos + 1}: top-k sets are disjoint",
                            {**base_ev, "label": labels[k], "summary": f"disjoint prefill top-k at position {pos + 1}"},
                            actual, reference, decode, None)
            positions += 1
            if len(common) < 2:
                continue  # one id: its centred value is 0 on both sides
            ma, mr = sum(a[t] for t in common) / len(common), sum(r[t] for t in common) / len(common)
            for t in common:
                d = (a[t] - ma) - (r[t] - mr)
                sq, points = sq + d * d, points + 1
                if abs(d) > worst:
                    worst, where = abs(d), (k, pos)
    rms = math.sqrt(sq / points) if points else 0.0
    if where is None:
        return rms, worst
    k, pos = where
    prefix = f"{labels[k]}: " if labels[k] else ""
    if worst > tol.free_running_atol:
        raise _fail(
            f"{prefix}prompt logprobs at position {pos + 1} differ (centred) by {worst:.4g} > gross bound "
            f"{tol.free_running_atol:g} ({tol.dtype})",
            {**base_ev, "label": labels[k], "summary": f"prefill diff {worst:.4g} > {tol.free_running_atol:g} at "
             f"position {pos + 1}", "position": pos + 1, "diff": worst}, actuals[k], references[k], decode, None)
    if rms > tol.prompt_rms_max:
        raise _fail(
            f"{prefix}prompt logprobs differ (centred, pooled over {points} points of {positions} positions in "
            f"{len(actuals)} request(s)) by rms {rms:.4g} > prompt_rms_max {tol.prompt_rms_max:g} ({tol.dtype}; "
            f"worst point {worst:.3g} at position {pos + 1} of this request)",
            {**base_ev, "label": labels[k], "summary": f"prefill rms {rms:.4g} > {tol.prompt_rms_max:g}",
             "rms": rms, "diff": worst}, actuals[k], references[k], decode, None)
    return rms, worst


def assert_tokens_equal(actual: GenerationResult, expected: GenerationResult, *, label: str = "",
                        decode: Decoder = None) -> None:
    """Exact equality of generated tokens (same engine, two runs: determinism, cache hit == miss)."""
    if actual.token_ids != expected.token_ids:
        step = next((i for i, (a, b) in enumerate(zip(actual.token_ids, expected.token_ids)) if a != b),
                    min(len(actual.token_ids), len(expected.token_ids)))
        raise _fail(f"{label + ': ' if label else ''}tokens differ from step {step}",
                    {"check": "tokens_equal", "label": label, "summary": f"tokens differ at step {step}",
                     "step": step}, actual, expected, decode, step)


def assert_same_output(actual: GenerationResult, expected: GenerationResult, *, atol: float = 0.0,
                       label: str = "", decode: Decoder = None) -> None:
    """Same engine, same request: tokens equal and every logprob within ``atol`` (0 = bit-identical)."""
    assert_tokens_equal(actual, expected, label=label, decode=decode)
    missing = missing_decode_logprobs(actual) or missing_decode_logprobs(expected)
    if missing:
        raise _fail(f"{label + ': ' if label else ''}{missing}",
                    {"check": "same_output", "label": label, "summary": "no decode logprobs"},
                    actual, expected, decode, None)
    pairs = list(zip(actual.logprobs, expected.logprobs))
    if actual.prompt_logprobs is not None and expected.prompt_logprobs is not None:
        pairs += list(zip(actual.prompt_logprobs, expected.prompt_logprobs))
    for i, (a, b) in enumerate(pairs):
        if a.keys() != b.keys():
            raise _fail(f"{label + ': ' if label else ''}top-k ids differ at entry {i}",
                        {"check": "same_output", "label": label, "summary": f"top-k ids differ at entry {i}"},
                        actual, expected, decode, None)
        d, tid = _max_common_diff(a, b)
        if d > atol:
            raise _fail(f"{label + ': ' if label else ''}logprob of id {tid} differs by {d:.3g} > {atol:g} at entry {i}",
                        {"check": "same_output", "label": label, "summary": f"logprob diff {d:.3g} at entry {i}",
                         "diff": d}, actual, expected, decode, None)
