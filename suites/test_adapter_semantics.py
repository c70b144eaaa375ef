"""Adapter semantics: ranks, alpha, rsLoRA, patterns, target sets, the zero adapter, layers.

DoRA, modules_to_save and LoRA biases: the engine either matches the reference or refuses
the adapter with a clear error. Loading it and silently ignoring part of it is a failure.
"""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci
from lora_conformance.judge import assert_logprobs_close
from lora_conformance.engines import AdapterIncompatibleError, EngineError, UnsupportedFeatureError
from lora_conformance.judge.paired import Alternatives

register_cpu_ci(est_time=35, suite="per-commit")
register_cuda_ci(est_time=25, suite="per-commit")
register_xpu_ci(est_time=40, suite="per-commit")
register_npu_ci(est_time=40, suite="per-commit")

PROMPTS = slice(0, 6)


def _check(lora, engine, name, spec, labels=None, prompts=PROMPTS, alternatives=Alternatives()):
    """The paired effect verdict (every certified alternative separable at this dtype, else a suite
    defect) and the free-running decode check."""
    lora.load(engine, name, spec)
    ps = lora.prompts[prompts]
    lora.assert_conforms(engine, labels or [name] * len(ps), {name: spec}, prompts=ps, label=name,
                         alternatives=alternatives)


@pytest.mark.feature("adapter_semantics/rank",
                      "adapters of rank 1 to the engine's max_rank are served as PEFT serves them")
@pytest.mark.profile_param("rank", lambda profile: [*profile.ranks, "max"])
def test_rank(lora, device, dtype, rank):
    """``max``: the limit of the engine as configured (its default, or the user's engine args)."""
    engine = lora.engine if rank == "max" else lora.engine_for_rank(rank)
    r = engine.limits.max_rank if rank == "max" else rank
    if r > engine.limits.max_rank:
        pytest.skip(f"not applicable: rank {r} above the engine's max_rank {engine.limits.max_rank}")
    _check(lora, engine, f"rank{r}", AdapterSpec(seed=11, rank=r, alpha=2 * r))


@pytest.mark.feature("adapter_semantics/rank_above_engine_max_is_refused",
                      "an adapter above the engine's max_rank is refused with a typed error")
def test_rank_above_engine_max_is_refused(lora, device, dtype):
    from lora_conformance.adapters import MAX_RANK

    engine = lora.engine
    too_big = engine.limits.max_rank + 1
    if too_big > MAX_RANK:
        pytest.skip(f"not applicable: the engine's max_rank {engine.limits.max_rank} is the largest rank synthesized")
    with pytest.raises(EngineError) as exc:
        lora.load(engine, "too_big", AdapterSpec(seed=12, rank=too_big))
    assert isinstance(exc.value, (AdapterIncompatibleError, UnsupportedFeatureError)), type(exc.value)
    message = str(exc.value)
    import re

    numbers = set(re.findall(r"\d+", message))
    assert "rank" in message.lower() and numbers & {str(too_big), str(engine.limits.max_rank)}, (
        f"the refusal must name the rank ({too_big}) or the limit ({engine.limits.max_rank}): {message!r}")


@pytest.mark.feature("adapter_semantics/mixed_ranks_in_one_batch",
                      "adapters of different ranks in one batch", requires=("mixed_batch",))
def test_mixed_ranks_in_one_batch(lora, device, dtype):
    engine = lora.engine_for_rank(32)
    specs = {"r2": AdapterSpec(seed=21, rank=2, alpha=4), "r16": AdapterSpec(seed=22, rank=16, alpha=32),
             "r32": AdapterSpec(seed=23, rank=min(32, engine.limits.max_rank), alpha=16)}
    for name, spec in specs.items():
        lora.load(engine, name, spec)
    lora.assert_conforms(engine, ["r2", "r16", None, "r32", "r2", "r16"], specs, label="mixed ranks")


@pytest.mark.feature("adapter_semantics/alpha_scaling", "the delta is scaled by lora_alpha / r")
@pytest.mark.parametrize("alpha", [4, 32])
def test_alpha_scaling(lora, device, dtype, alpha):
    _check(lora, lora.engine, f"alpha{alpha}", AdapterSpec(seed=31, rank=8, alpha=alpha))


@pytest.mark.feature("adapter_semantics/rslora",
                      "use_rslora scales the delta by lora_alpha / sqrt(r)", requires=("rslora",))
def test_rslora(lora, device, dtype):
    _check(lora, lora.engine, "rslora", AdapterSpec(seed=41, rank=16, alpha=8, use_rslora=True))


@pytest.mark.feature("adapter_semantics/rank_and_alpha_patterns",
                      "rank_pattern / alpha_pattern override r and alpha per module", requires=("rank_pattern",))
def test_rank_and_alpha_patterns(lora, device, dtype):
    spec = AdapterSpec(seed=51, rank=8, alpha=16, rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 16},
                       alpha_pattern={"q_proj": 32})
    _check(lora, lora.engine, "patterns", spec)


# B std per module for the tests that certify single modules dropped (the default is 0.03: q_proj 5x,
# k_proj 15x, down_proj 2x; test_target_set says why).
STRONG_MODULES = {"q_proj": 0.15, "k_proj": 0.45, "down_proj": 0.06}


@pytest.mark.feature("adapter_semantics/target_set",
                      "attention, MLP and all-linear target sets: every targeted module's delta is applied")
@pytest.mark.parametrize("targets", ["attention", "mlp", "all-linear"])
def test_target_set(lora, device, dtype, targets):
    """Each targeted module dropped is an alternative the test must separate, in every dtype: q_proj and
    k_proj move the output little at the default B std (bfloat16 could not tell them dropped), so q_proj's
    B is 5x stronger here and k_proj's 15x. k_proj needs more: the synthetic bases carry the attention
    gain in k_proj (models/synthetic.py), which amplifies a q_proj delta and not a k_proj one, so at 5x on
    the real shapes (profile full, bfloat16, a Q4_K base read with 8-bit activations) "k_proj LoRA
    dropped" had gamma standard error 0.13 (attention) / 0.15 (all-linear), above the 0.1 the verdict
    needs; at 15x 0.03 / 0.04 (the fast profile's bfloat16: 0.04 at 5x, 0.02 at 15x). down_proj's 2x and
    16 prompts keep its drop separable with a bfloat16 run's own noise (gamma standard error 0.14 at 1x
    and 12 prompts; 0.04 at 2x and 16 on the real shapes above)."""
    spec = AdapterSpec(seed=61, targets=targets, b_std_pattern=STRONG_MODULES)
    _check(lora, lora.engine, f"t-{targets}", spec, prompts=slice(0, 16), alternatives=Alternatives(modules=True))


@pytest.mark.feature("adapter_semantics/embed_tokens", "embed_tokens LoRA is applied", requires=("embed_tokens",))
def test_embed_tokens(lora, device, dtype):
    _check(lora, lora.engine, "embed", AdapterSpec(seed=71, targets="embed_tokens"))


@pytest.mark.feature("adapter_semantics/lm_head", "lm_head LoRA is applied", requires=("lm_head",))
def test_lm_head(lora, device, dtype):
    _check(lora, lora.engine, "head", AdapterSpec(seed=72, targets="lm_head", b_std=0.15))


@pytest.mark.feature("adapter_semantics/zero_adapter_equals_base",
                      "an adapter with B = 0 gives the base model's outputs")
def test_zero_adapter_equals_base(lora, device, dtype):
    engine = lora.engine
    lora.load(engine, "zero", AdapterSpec(seed=81, zero=True))
    reqs = lora.requests(["zero"] * 4, prompts=lora.prompts[:4])
    base = engine.generate(lora.requests([None] * 4, prompts=lora.prompts[:4]))
    for i, (z, b) in enumerate(zip(engine.generate(reqs), base)):
        assert_logprobs_close(z, b, lora.same_engine_tolerance, label=f"zero adapter vs base, prompt {i}", decode=lora.decode)


@pytest.mark.feature("adapter_semantics/layers_to_transform",
                      "layers_to_transform restricts the adapter to the named layers")
def test_layers_to_transform(lora, device, dtype):
    """One layer's LoRA must move the output enough to tell x0.9 / x1.1 from the correct delta: on a
    28-layer base (the full profile) one layer at the default B std could not (gamma standard error
    0.22 in bfloat16), so its modules are as strong as target_set's, the others at 2x the default B std,
    and it is judged on 16 prompts. Without the 2x (bfloat16, a Q4_K base read with 8-bit activations)
    x0.9 / x1.1 had gamma standard error 0.09 / 0.08, v_proj dropped 0.07; with it 0.05 / 0.04 / 0.03."""
    spec = AdapterSpec(seed=91, targets="all-linear", layers_to_transform=(1,), b_std=0.06,
                       b_std_pattern=STRONG_MODULES)
    _check(lora, lora.engine, "layer1", spec, prompts=slice(0, 16))


REFUSABLE = {
    "dora": AdapterSpec(seed=101, use_dora=True),
    "modules_to_save": AdapterSpec(seed=102, modules_to_save=("lm_head",)),
    "bias": AdapterSpec(seed=103, bias="lora_only"),
}


@pytest.mark.feature("adapter_semantics/matches_or_refuses",
                      "DoRA, modules_to_save and LoRA biases are served exactly or refused clearly")
@pytest.mark.parametrize("feature", list(REFUSABLE))
def test_matches_or_refuses(lora, device, dtype, feature):
    """Either the engine serves the adapter exactly as PEFT does, or it refuses it with a clear error."""
    engine = lora.engine
    spec = REFUSABLE[feature]
    refusals = (AdapterIncompatibleError, UnsupportedFeatureError)  # a crash (EngineFailure) is no refusal
    try:
        lora.load(engine, feature, spec)
    except refusals as exc:
        assert str(exc).strip(), f"{feature}: refused without a reason"
        return
    try:
        engine.generate(lora.requests([feature], prompts=lora.prompts[:1], max_new_tokens=1))
    except UnsupportedFeatureError as exc:  # refusing at first use is a refusal too
        assert str(exc).strip(), f"{feature}: refused without a reason"
        return
    lora.assert_conforms(engine, [feature] * 4, {feature: spec}, prompts=lora.prompts[:4],
                         label=f"{feature} (accepted, so it must match)")
