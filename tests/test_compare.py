"""The comparison library on hand-made outputs: each check passes on agreement and fails on each way of disagreeing."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_conformance.judge import (
    BASE,
    ConformanceAssertionError,
    IndistinctReferencesError,
    assert_embeddings_close,
    assert_logprobs_close,
    assert_nearest_reference_routing,
    output_distance,
    assert_rouge_l,
    assert_same_output,
    rouge_l,
    tolerance_for,
)
from lora_conformance.types import GenerationResult


def result(tokens, lps=None, prompt=None, text=None):
    """Each step's top-k: the chosen token at its logprob, then two runners-up 1.0 and 2.0 below."""
    lps = lps or [-0.1] * len(tokens)
    steps = [{t: lp, 900 + i: lp - 1.0, 950 + i: lp - 2.0} for i, (t, lp) in enumerate(zip(tokens, lps))]
    return GenerationResult(token_ids=list(tokens), text=text or " ".join(f"w{t}" for t in tokens),
                            logprobs=steps, prompt_logprobs=prompt)


def test_identical_outputs_agree():
    ref = result([1, 2, 3, 4])
    a = assert_logprobs_close(result([1, 2, 3, 4]), ref, "float32")
    assert a.steps_compared == 4 and a.tie_at is None and a.max_decode_diff == 0


def test_logprob_drift_beyond_tolerance_fails_with_table():
    tol = tolerance_for("float32").decode_atol
    ref = result([1, 2, 3])
    bad = result([1, 2, 3], lps=[-0.1, -0.1 - 3 * tol, -0.1])
    with pytest.raises(ConformanceAssertionError) as exc:
        assert_logprobs_close(bad, ref, "float32", label="slot 0")
    msg = str(exc.value)
    assert "step 1" in msg and "decode_atol" in msg and "reference" in msg  # side-by-side table
    assert exc.value.evidence["check"] == "logprobs_close"
    assert exc.value.evidence["rows"][1]["step"] == 1


def test_drift_within_tolerance_passes():
    tol = tolerance_for("bfloat16").decode_atol
    ref = result([1, 2, 3])
    a = assert_logprobs_close(result([1, 2, 3], lps=[-0.1, -0.1 + tol / 2, -0.1]), ref, "bfloat16")
    assert math.isclose(a.max_decode_diff, tol / 2, rel_tol=1e-6)


def tie_pair(gap):
    """Reference prefers 5 over 6 by ``gap``; the engine picks 6."""
    ref = GenerationResult(token_ids=[1, 5, 7], text="", logprobs=[{1: -0.1, 2: -3.0}, {5: -0.7, 6: -0.7 - gap}, {7: -0.1}])
    act = GenerationResult(token_ids=[1, 6, 8], text="", logprobs=[{1: -0.1, 2: -3.0}, {5: -0.7, 6: -0.7 - gap}, {8: -0.1}])
    return act, ref


def test_divergence_at_a_tie_is_tolerated_and_stops():
    act, ref = tie_pair(gap=tolerance_for("bfloat16").tie_margin / 4)
    a = assert_logprobs_close(act, ref, "bfloat16")
    assert a.tie_at == 1 and a.steps_compared == 1 and a.notes


def test_divergence_at_a_decided_step_fails():
    act, ref = tie_pair(gap=1.5)
    with pytest.raises(ConformanceAssertionError, match="decided"):
        assert_logprobs_close(act, ref, "bfloat16")


def test_divergence_outside_topk_fails():
    ref = result([1, 2, 3])
    act = result([1, 42, 3])
    with pytest.raises(ConformanceAssertionError, match="not in the reference top-k"):
        assert_logprobs_close(act, ref, "float32")


def flat_pair(engine_lp: float, scored: dict):
    """The reference prefers 5 at step 1 and its top-k leaves out 42, the engine's choice; ``scored``
    is what the reference says of 5 and 42 there when asked (teacher-forced)."""
    ref = GenerationResult(token_ids=[1, 5, 7], text="",
                           logprobs=[{1: -0.1, 2: -3.0}, {5: -2.26, 6: -2.2603, 7: -2.3, 8: -2.35, 9: -2.4}, {7: -0.1}])
    act = GenerationResult(token_ids=[1, 42, 8], text="",
                           logprobs=[{1: -0.1, 2: -3.0}, {42: engine_lp, 5: -2.3, 6: -2.31}, {8: -0.1}])
    asked = []

    def resolve(step, ids):
        asked.append((step, list(ids)))
        return {t: scored[t] for t in ids if t in scored} or None
    return act, ref, resolve, asked


def test_an_engine_token_outside_the_reference_topk_is_scored_by_the_reference():
    """At a flat step the engine may pick a token the reference's top 5 leave out: the reference scores
    it (teacher-forced) and the divergence is judged on that: a tie where it lies within tie_margin of
    the reference's token and decode_atol of the engine's logprob, a failure otherwise, and without a
    reference to ask the old failure."""
    tol = tolerance_for("bfloat16")
    act, ref, resolve, asked = flat_pair(-2.06, {5: -2.26, 42: -2.45})
    a = assert_logprobs_close(act, ref, tol, resolve=resolve)
    assert a.tie_at == 1 and asked == [(1, [5, 42])] and any("scored" in n for n in a.notes)
    # the reference decided against 42: a decisive divergence, however the engine scores it
    act, ref, resolve, _ = flat_pair(-2.06, {5: -2.26, 42: -2.26 - tol.tie_margin - 0.1})
    with pytest.raises(ConformanceAssertionError, match="decided .*scored by the reference") as exc:
        assert_logprobs_close(act, ref, replace(tol, decode_atol=10.0), resolve=resolve)
    assert exc.value.evidence["scored"] == {"5": -2.26, "42": pytest.approx(-2.26 - tol.tie_margin - 0.1)}
    # the engine's logprob of its token is off from the reference's
    act, ref, resolve, _ = flat_pair(-2.06, {5: -2.26, 42: -2.06 - tol.decode_atol - 0.05})
    with pytest.raises(ConformanceAssertionError, match="scored by the reference: logprob differs"):
        assert_logprobs_close(act, ref, replace(tol, tie_margin=10 * tol.decode_atol), resolve=resolve)
    # nobody to ask, or the reference cannot say: the top-k rule as before
    act, ref, _, _ = flat_pair(-2.06, {})
    for resolve in (None, lambda step, ids: None):
        with pytest.raises(ConformanceAssertionError, match="not in the reference top-k"):
            assert_logprobs_close(act, ref, tol, resolve=resolve)


def test_a_reference_token_outside_the_engine_topk_is_bounded_by_it():
    """Neither token in the other's top-k (the full profile's slot_saturation on the H200, twice): the
    reference scores the engine's token, and the engine's top-k bounds its logprob of the reference's
    token (at most the lowest it lists); a reference logprob within decode_atol of that floor and an
    undecided reference make a tie, a floor further below fails, and so does a decided reference."""
    tol = tolerance_for("bfloat16")
    act, ref, resolve, asked = flat_pair(-2.06, {5: -2.26, 42: -2.3})
    act.logprobs[1] = {42: -2.06, 6: -2.31}
    a = assert_logprobs_close(act, ref, tol, resolve=resolve)
    assert a.tie_at == 1 and asked == [(1, [5, 42])]
    assert any("outside the engine's top-k" in n and "at most -2.31" in n for n in a.notes)
    # the engine puts the reference's token below -2.26 - decode_atol: measured, and off
    act, ref, resolve, _ = flat_pair(-2.06, {5: -2.26, 42: -2.3})
    floor = -2.26 - tol.decode_atol - 0.05
    act.logprobs[1] = {42: -2.06, 6: -2.31, 9: floor}
    with pytest.raises(ConformanceAssertionError, match="outside the engine top-k, is at most") as exc:
        assert_logprobs_close(act, ref, tol, resolve=resolve)
    assert exc.value.evidence["engine_floor"] == floor and exc.value.evidence["diff"] == pytest.approx(
        tol.decode_atol + 0.05)
    # within the floor, but the reference decided against the engine's token
    act, ref, resolve, _ = flat_pair(-2.06, {5: -2.26, 42: -2.26 - tol.tie_margin - 0.1})
    act.logprobs[1] = {42: -2.06, 6: -2.31}
    with pytest.raises(ConformanceAssertionError, match="decided"):
        assert_logprobs_close(act, ref, replace(tol, decode_atol=10.0), resolve=resolve)
    # the engine's token in the reference's top-k, the reference's outside the engine's: the same floor
    ref = GenerationResult(token_ids=[1, 5], text="", logprobs=[{1: -0.1}, {5: -2.26, 42: -2.27, 7: -2.3}])
    act = GenerationResult(token_ids=[1, 42], text="", logprobs=[{1: -0.1}, {42: -2.2, 7: -2.25}])
    assert assert_logprobs_close(act, ref, tol).tie_at == 1
    act = GenerationResult(token_ids=[1, 42], text="", logprobs=[{1: -0.1}, {42: -2.2, 7: -2.25, 8: -3.5}])
    with pytest.raises(ConformanceAssertionError, match="outside the engine top-k"):
        assert_logprobs_close(act, ref, tol)


def test_prefill_tolerance():
    ref = result([1], prompt=[{3: -0.5, 4: -1.0}, {5: -0.2, 6: -2.0}])
    ok = result([1], prompt=[{3: -0.5, 4: -1.0}, {5: -0.2, 6: -2.0}])
    assert_logprobs_close(ok, ref, "float32")
    bad = result([1], prompt=[{3: -0.5, 4: -1.0}, {5: -0.4, 6: -2.0}])
    with pytest.raises(ConformanceAssertionError, match="prompt logprobs at position 2"):
        assert_logprobs_close(bad, ref, "float32")


def test_prompt_logprobs_are_pooled_not_judged_per_position():
    """One position of a correct bfloat16 engine may move by 0.47 (refactored LoRA factors): the
    pooled rms over the prompt decides, and a shift at every position still fails."""
    import random

    rng = random.Random(3)
    ref_rows = [{i: -rng.uniform(0.1, 6.0) for i in range(10 * p, 10 * p + 5)} for p in range(20)]
    ref = result([1], prompt=ref_rows)
    one = [dict(r) for r in ref_rows]
    k = min(one[7])
    one[7][k] += 0.47 * 5 / 4  # centred: 0.47 on that id
    ag = assert_logprobs_close(result([1], prompt=one), ref, "bfloat16")
    assert 0.46 < ag.max_prefill_diff < 0.48 and ag.prefill_rms < 0.1
    # pooled over several requests: a request alone over the bound, the check's requests together not
    from lora_conformance.judge import assert_prompt_logprobs_close

    short = result([1], prompt=[{1: -0.5, 2: -1.0, 3: -2.0}])
    off = result([1], prompt=[{1: -0.5 + 0.9, 2: -1.0, 3: -2.0}])
    with pytest.raises(ConformanceAssertionError, match="prompt_rms_max"):
        assert_logprobs_close(off, short, "bfloat16")
    rms, worst = assert_prompt_logprobs_close([off, result([1], prompt=ref_rows)], [short, ref], "bfloat16")
    assert rms < 0.3 and 0.5 < worst < 0.7
    everywhere = [dict(r) for r in ref_rows]
    for r in everywhere:
        for i in list(r)[:2]:
            r[i] += 0.8  # centred: 0.48, 0.48, -0.32 x 3 at every position (rms 0.39)
    with pytest.raises(ConformanceAssertionError, match="rms .* > prompt_rms_max"):
        assert_logprobs_close(result([1], prompt=everywhere), ref, "bfloat16")
    from lora_conformance.judge import tolerance_for

    bound = tolerance_for("bfloat16").free_running_atol
    long_rows = [{i: -rng.uniform(0.1, 6.0) for i in range(10 * p, 10 * p + 5)} for p in range(60)]
    gross = [dict(r) for r in long_rows]
    gross[3][min(gross[3])] += (bound + 0.1) * 5 / 4  # centred: just over free_running_atol (a single point)
    with pytest.raises(ConformanceAssertionError, match="gross bound"):
        assert_logprobs_close(result([1], prompt=gross), result([1], prompt=long_rows), "bfloat16")


def test_length_mismatch_and_empty_output_fail():
    with pytest.raises(ConformanceAssertionError, match="tokens"):
        assert_logprobs_close(result([1, 2]), result([1, 2, 3]), "float32")
    with pytest.raises(ConformanceAssertionError, match="no tokens"):
        assert_logprobs_close(GenerationResult([], ""), result([1]), "float32")


_WORDS = ["the", "cat", "Sat", "on", "mat", "dog", "a1", "42", "état", "--", "it's", "x_y", ""]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(_WORDS), max_size=12), st.lists(st.sampled_from(_WORDS), max_size=12),
       st.sampled_from([" ", "  ", ", ", "\n", ".", ""]))
def test_rouge_l_equals_rouge_score(a, b, sep):
    """Our ROUGE-L on text is rouge-score's RougeScorer(["rougeL"], use_stemmer=False), token for token."""
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    actual, reference = sep.join(a), sep.join(b)
    if not actual.strip() and not reference.strip():
        assert rouge_l(actual, reference) == 1.0  # ours: two blank texts agree (rouge-score says 0)
        return
    want = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(reference, actual)["rougeL"].fmeasure
    assert rouge_l(actual, reference) == pytest.approx(want, abs=1e-12)


def test_rouge_l_text_and_ids():
    assert rouge_l("the cat sat", "the cat sat") == 1.0
    assert 0 < rouge_l("the cat sat on mat", "the dog sat on the mat") < 1
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 9]) == pytest.approx(0.75)
    assert rouge_l([1, 2], [3, 4]) == 0.0
    with pytest.raises(TypeError):
        rouge_l("a b", [1, 2])
    assert_rouge_l("a b c d", "a b c d", 1.0)
    with pytest.raises(ConformanceAssertionError, match="ROUGE-L"):
        assert_rouge_l("a b x y", "a b c d", 0.9)


REFS = {"A": result([1, 2, 3, 4]), "B": result([5, 6, 7, 8]), BASE: result([9, 10, 11, 12])}


def test_routing_passes_when_each_slot_is_nearest_its_own():
    # slot 2 leaves B's decode at step 3 for B's runner-up there (a gap of 1.0): still nearest B
    near_b = result([5, 6, 7, 903])
    near_b.logprobs[3] = {903: -0.1, 8: -0.3, 990: -2.0}
    outs = [result([1, 2, 3, 4]), result([9, 10, 11, 12]), near_b]
    assert assert_nearest_reference_routing(outs, ["A", None, "B"], REFS) == ["A", BASE, "B"]


def test_routing_compares_only_steps_with_the_same_context():
    """A's output breaks a near-tie of A's reference at step 1 (gap 0.05) and goes on as C's
    reference does: it shares 5 of 6 tokens with C (ROUGE-L 0.83) and 1 with A, but the only steps
    it saw A's context on agree with A, and C's reference was decided against its first token. The
    seed's ROUGE-L distance called it C's (the bfloat16 false alarm of correct engines)."""
    a_ref, c_ref = result([1, 2, 3, 4, 5, 6]), result([7, 8, 21, 22, 23, 24])
    a_ref.logprobs[1] = {2: -0.6, 8: -0.65, 99: -3.0}
    out = result([1, 8, 21, 22, 23, 24])
    out.logprobs[1] = {8: -0.62, 2: -0.64, 99: -3.0}
    refs = {"A": a_ref, "C": c_ref, BASE: result([9, 10, 11, 12, 13, 14])}
    assert output_distance(out, a_ref) == pytest.approx(0.05)
    assert output_distance(out, c_ref) >= 2.0
    assert assert_nearest_reference_routing([out], ["A"], refs) == ["A"]


def test_routing_catches_base_row_receiving_an_adapter():
    outs = [result([1, 2, 3, 4]), result([1, 2, 3, 4]), result([5, 6, 7, 8])]
    with pytest.raises(ConformanceAssertionError) as exc:
        assert_nearest_reference_routing(outs, ["A", None, "B"], REFS)
    assert "slot 1 expected '__base__' but is nearest 'A'" in str(exc.value)
    assert exc.value.evidence["rows"][1]["nearest"] == "A"


def test_routing_catches_swapped_adapters_and_identical_outputs():
    with pytest.raises(ConformanceAssertionError, match="slot 0 expected 'A'"):
        assert_nearest_reference_routing([result([5, 6, 7, 8]), result([1, 2, 3, 4])], ["A", "B"], REFS)
    with pytest.raises(ConformanceAssertionError, match="all outputs are identical"):
        # every row served by the base model: all identical although A, B and base are mixed
        assert_nearest_reference_routing([result([9, 10, 11, 12])] * 3, ["A", "B", None], REFS)


def test_routing_refuses_indistinct_references():
    refs = {"A": result([1, 2]), "B": result([1, 2])}
    with pytest.raises(IndistinctReferencesError):
        assert_nearest_reference_routing([result([1, 2]), result([1, 2])], ["A", "B"], refs)


def test_routing_uses_logprobs_to_break_token_ties():
    # Same tokens for A and B; only logprobs tell them apart.
    refs = {"A": result([1, 2, 3], lps=[-0.1, -0.1, -0.1]), "B": result([1, 2, 4], lps=[-0.5, -0.5, -0.5])}
    out = result([1, 2, 3], lps=[-0.12, -0.1, -0.1])
    assert assert_nearest_reference_routing([out], ["A"], refs) == ["A"]


def test_embeddings_close():
    assert_embeddings_close([[1.0, 0.0]], [[0.99, 0.01]], 0.99)
    with pytest.raises(ConformanceAssertionError, match="cosine"):
        assert_embeddings_close([[1.0, 0.0]], [[0.0, 1.0]], 0.99)


def test_same_output_is_exact():
    a = result([1, 2, 3])
    assert_same_output(a, result([1, 2, 3]))
    with pytest.raises(ConformanceAssertionError):
        assert_same_output(a, result([1, 2, 3], lps=[-0.1, -0.1, -0.10001]))


def test_every_dtype_has_a_tolerance_and_unknown_is_refused():
    for d in ("float32", "bfloat16", "float16"):
        t = tolerance_for(d)
        assert 0 < t.decode_atol and 0 < t.tie_margin and 0 < t.embedding_cos_min <= 1
    assert tolerance_for("float32").decode_atol < tolerance_for("float16").decode_atol < tolerance_for("bfloat16").decode_atol
    with pytest.raises(ValueError, match="no tolerance"):
        tolerance_for("int8")
