"""The paired effect statistics (judge/effects.py), hypotheses and teacher-forced reference scoring."""

import math
import random

import pytest

from lora_conformance.judge import hypotheses as hyps
from lora_conformance.judge.effects import (
    EffectSample,
    SuiteDefectError,
    analyse,
    assert_effects_conform,
    projection,
)
from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.tolerances import tolerance_for

BF16 = tolerance_for("bfloat16")


def _sample(engine_of, noise=0.02, contexts=60, ids=6, seed=0, correlated=0.0):
    """R: a random reference effect; H: alternatives (x0.9, x1.1, 'down dropped' = R minus a part);
    E = engine_of(R, H) + noise (optionally a shared per-context offset, which centring would remove
    in real data; here it tests the cluster-robust SE)."""
    rng = random.Random(seed)
    s = EffectSample("X")
    for c in range(contexts):
        shared = rng.gauss(0, correlated)
        part = [rng.gauss(0, 0.3) for _ in range(ids)]
        R = [rng.gauss(0, 1.0) + p for p in part]
        H = {"delta x0.9": [0.9 * r for r in R], "delta x1.1": [1.1 * r for r in R],
             "down_proj LoRA dropped": [r - p for r, p in zip(R, part)], "base": [0.0] * ids}
        E = engine_of(R, H)
        s.E += [e + rng.gauss(0, noise) + shared for e in E]
        s.R += R
        for k, v in H.items():
            s.H.setdefault(k, []).extend(v)
        s.cluster += [c] * ids
        s.contexts += 1
    return s


def test_correct_engine_passes_and_is_nearest_correct():
    a = analyse(_sample(lambda R, H: R), BF16)
    assert not a.failures and not a.defects, a.failures + a.defects
    assert a.nearest == "correct"
    assert abs(a.slope - 1) < 0.01 and all(abs(f.gamma) < 0.1 for f in a.fits)
    assert_effects_conform([a])


@pytest.mark.parametrize("bug", ["delta x1.1", "delta x0.9", "down_proj LoRA dropped", "base"])
def test_each_bug_is_caught_and_named(bug):
    a = analyse(_sample(lambda R, H: H[bug]), BF16)
    assert a.nearest == bug
    with pytest.raises(ConformanceAssertionError) as exc:
        assert_effects_conform([a], label="t")
    assert f"closest to: {bug}" in str(exc.value)
    assert exc.value.evidence["hypothesis"]["nearest"] == bug


def test_a_mis_scale_between_hypotheses_fails_on_the_slope():
    a = analyse(_sample(lambda R, H: [1.05 * r for r in R]), BF16)
    assert any("effective scale" in f for f in a.failures), a.failures


def test_noise_above_the_bound_fails():
    a = analyse(_sample(lambda R, H: R, noise=3 * BF16.effect_noise_max), BF16)
    assert any("residual rms" in f for f in a.failures)


def test_inseparable_alternative_is_a_suite_defect():
    s = _sample(lambda R, H: R, contexts=2, ids=3)
    # A tiny effect: every hypothesis is within the noise.
    s.R = [r * 1e-3 for r in s.R]
    s.E = list(s.R)
    s.H = {k: [x * 1e-3 for x in v] for k, v in s.H.items()}
    s.E = s.E * 20
    s.R = s.R * 20
    s.H = {k: v * 20 for k, v in s.H.items()}
    s.cluster = list(range(len(s.E)))
    with pytest.raises(SuiteDefectError, match="cannot tell"):
        assert_effects_conform([analyse(s, BF16)])


def test_too_few_points_fail():
    a = analyse(_sample(lambda R, H: R, contexts=3, ids=3), BF16)
    assert any("comparable points" in f for f in a.failures)


def test_cluster_robust_se_grows_with_within_context_correlation():
    rng = random.Random(1)
    d = [rng.gauss(0, 1) for _ in range(400)]
    clusters = [i // 8 for i in range(400)]
    iid = [rng.gauss(0, 0.1) for _ in range(400)]
    shared = {c: rng.gauss(0, 0.1) for c in set(clusters)}
    corr = [shared[c] * abs(x) for c, x in zip(clusters, d)]
    _, se_iid = projection(iid, d, clusters)
    _, se_corr = projection(corr, d, clusters)
    assert se_corr > se_iid
    coef, _ = projection([2 * x for x in d], d, clusters)
    assert math.isclose(coef, 2.0)


def test_standard_hypotheses_follow_the_adapter_config(tmp_path):
    import json

    def cfg(**kw):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, **kw}))
        return d

    names = [h.name for h in hyps.standard(cfg(target_modules=["q_proj", "v_proj"]), others=["B"])]
    assert names[:2] == ["delta x0.9", "delta x1.1"]
    assert {"q_proj LoRA dropped", "v_proj LoRA dropped", "alpha not over r", "served as B", "base"} <= set(names)
    assert "rsLoRA ignored" not in names and "patterns ignored" not in names
    names = [h.name for h in hyps.standard(cfg(target_modules=["q_proj"], use_rslora=True,
                                               rank_pattern={"q_proj": 4}))]
    assert "rsLoRA ignored" in names and "patterns ignored" in names
    assert not any("dropped" in n for n in names), "one target: dropping it is the base hypothesis"
    assert "alpha not over r" not in [h.name for h in hyps.standard(cfg(r=1, target_modules=["q_proj"]))]


def test_context_scoring_matches_free_running_reference_and_hypotheses_apply(llama, tmp_path):
    """Teacher forcing on the reference's own continuation reproduces its per-step logprobs; a
    hypothesis changes them and leaves the model as it was."""
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.judge.paired import contexts_of
    from lora_conformance.reference import ReferenceRunner

    adapter = synthesize_adapter(llama, AdapterSpec(seed=9), tmp_path / "a")
    runner = ReferenceRunner(llama)
    row = contexts_of(runner, "A", "the old man", adapter, 6)
    assert sum(t is not None for t in row.texts) >= 5
    from lora_conformance.types import GenerationRequest

    free = runner.generate([GenerationRequest("the old man", "A", 6, 5)], {"A": adapter})[0]
    forced = runner.context_logprobs([row.sequence], [row.positions], adapter, top=5)[0]
    for step, (f, t) in enumerate(zip(free.logprobs, forced)):
        assert f.keys() == t.keys(), step
        assert max(abs(f[k] - t[k]) for k in f) < 1e-4, step
    ids = [sorted(t) for t in forced]
    dropped = runner.context_logprobs([row.sequence], [row.positions], adapter,
                                      hyps.Hypothesis("v", "v dropped", "drop", module="v_proj"), ids=[ids])[0]
    assert max(abs(dropped[0][k] - forced[0][k]) for k in forced[0]) > 1e-3
    again = runner.context_logprobs([row.sequence], [row.positions], adapter, ids=[ids])[0]
    assert max(abs(again[0][k] - forced[0][k]) for k in forced[0]) < 1e-5, "scaling restored after the hypothesis"


def test_expert_routing_hypotheses_are_the_engine_faults(tmp_path):
    """The reference's expert-level hypotheses (an expert's down_proj LoRA output weighted 1 or with
    the next selected expert's weight, LoRA on the first selected expert only) reproduce the built-in
    engine's faults of those names in float32, and are far from the correct hypothesis."""
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.engines import create_engine
    from lora_conformance.models import resolve_base_model
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    moe = resolve_base_model("synthetic:moe", tmp_path / "models")
    adapter = synthesize_adapter(moe, AdapterSpec(seed=501, targets="moe_experts",
                                                  b_std_pattern={"experts.lora_B": 0.06}), tmp_path / "m")
    names = [h.name for h in hyps.standard(adapter)]
    assert {hyps.expert_routing(m).name for m in hyps.EXPERT_ROUTING} <= set(names)
    runner = ReferenceRunner(moe)
    prompt = "the old man saw a big red dragon in the deep blue sea"
    ids = list(runner.tokenizer(prompt).input_ids)
    pos = list(range(len(ids) - 1))
    for fault, mode in (("moe_lora_unweighted", "unweighted"), ("moe_lora_weight_of_next_expert", "next_expert"),
                        ("moe_lora_first_expert_only", "first_only")):
        with create_engine("builtin", moe, "cpu", "float32", {"fault": fault}) as engine:
            engine.load_adapter("M", adapter)
            got = engine.generate([GenerationRequest(prompt, "M", 1, 20, prompt_logprobs=True)])[0].prompt_logprobs
        want = [sorted(x) for x in got]
        hyp = runner.context_logprobs([ids], [pos], adapter, hyps.expert_routing(mode), ids=[want])[0]
        right = runner.context_logprobs([ids], [pos], adapter, ids=[want])[0]
        to_hyp = max(abs(got[j][t] - hyp[j][t]) for j in range(len(pos)) for t in want[j])
        to_right = max(abs(got[j][t] - right[j][t]) for j in range(len(pos)) for t in want[j])
        assert to_hyp < 1e-4 and to_right > 0.05, (fault, to_hyp, to_right)


def test_prompt_logprobs_paired_verdict_passes_correct_and_names_a_misscale(llama, tmp_path):
    """paired.run_prompt_logprobs: every prompt position a context; the correct engine conforms,
    an engine whose delta is 10% too large is judged nearest 'delta x1.1'."""
    from lora_conformance.judge import paired
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.judge import tolerance_for
    from lora_conformance.engines import create_engine
    from lora_conformance.models import default_prompts
    from lora_conformance.reference import ReferenceRunner

    adapter = synthesize_adapter(llama, AdapterSpec(seed=9), tmp_path / "a")
    runner = ReferenceRunner(llama)
    labels = ["A"] * 6 + [None, None]
    alts = paired.default_alternatives(labels, {"A": adapter})
    plan = paired.Plan(labels, default_prompts()[:8], {"A": adapter}, alts, paired.required_hypotheses(alts))
    for args, nearest in (({}, "correct"), ({"fault": "delta_x1_1"}, "delta x1.1")):
        with create_engine("builtin", llama, "cpu", "float32", args) as engine:
            engine.load_adapter("A", adapter)
            analyses = paired.run_prompt_logprobs(plan, engine, runner, tolerance_for("float32"))
        a = next(x for x in analyses if x.label == "A")
        assert a.contexts >= 40 and not a.defects, (a.contexts, a.defects)
        assert a.nearest == nearest and bool(a.failures) == (nearest != "correct"), a.summary()
        assert not next(x for x in analyses if x.label == paired.BASE_LABEL).failures
