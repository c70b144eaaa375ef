"""Mixed batches and routing: each request gets its own adapter (or none) inside one batch.

Every row's adapter effect must match its own isolated reference's and be nearest it among the
alternatives, "served as" each other adapter of the batch included (``lora.assert_conforms``,
teacher-forced and paired); base rows must show no effect. The nearest-reference assertion
checks routing of free-running decodes; base rows must equal a run with no adapters loaded;
slots are saturated and oversubscribed; batch size and order must not matter.
"""

import random

import pytest

from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci
from lora_conformance.judge import assert_logprobs_close, assert_nearest_reference_routing
from lora_conformance.hypothesis_profile import given, note, st
from lora_conformance.types import GenerationRequest

register_cpu_ci(est_time=35, suite="per-commit")
register_cuda_ci(est_time=25, suite="per-commit")
register_xpu_ci(est_time=40, suite="per-commit")
register_npu_ci(est_time=40, suite="per-commit")

pytestmark = pytest.mark.requires("mixed_batch")

COMPOSITIONS = {
    "A-B-base": ["A", "B", None],
    "base-A-B": [None, "A", "B"],
    "A-base-B": ["A", None, "B"],
    "all-base": [None, None, None],
    "all-same": ["A", "A", "A"],
}


def _same_prompt_routing_batch(lora, labels, prompt):
    return [GenerationRequest(prompt=prompt, adapter=l, max_new_tokens=16) for l in labels]


@pytest.mark.feature("mixed_batch/composition_matches_isolated_references",
                      "each row of a mixed batch matches its own isolated reference")
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_composition_matches_isolated_references(lora, device, dtype, composition):
    engine = lora.engine
    labels = COMPOSITIONS[composition] * 3
    lora.require_loaded(engine, len({l for l in labels if l}))
    for name in {l for l in labels if l}:
        lora.load(engine, name)
    lora.assert_conforms(engine, labels, label=composition)


@pytest.mark.feature("mixed_batch/nearest_reference_routing",
                      "each row of a mixed batch is nearest its own adapter's reference")
@pytest.mark.parametrize("prompt_index", [0, 3, 8])
def test_nearest_reference_routing(lora, device, dtype, prompt_index):
    """One prompt, every slot a different adapter or base: each output is nearest its own reference."""
    engine = lora.engine
    lora.require_loaded(engine, 3)
    for name in ("A", "B", "C"):
        lora.load(engine, name)
    labels = ["A", "B", None, "C", "B", None, "A", "C"]
    prompt = lora.prompts[prompt_index]
    reqs = _same_prompt_routing_batch(lora, labels, prompt)
    outs = engine.generate(reqs)
    refs = {l or "__base__": r for l, r in zip(["A", "B", "C", None],
                                               lora.reference(_same_prompt_routing_batch(lora, ["A", "B", "C", None], prompt)))}
    assert_nearest_reference_routing(outs, labels, refs, decode=lora.decode, label=f"prompt {prompt_index}")


@pytest.mark.feature("mixed_batch/base_rows_equal_a_run_without_adapters",
                      "base rows of a mixed batch equal a run with no adapters loaded")
def test_base_rows_equal_a_run_without_adapters(lora, device, dtype):
    """The baseline is the engine's own run of the base rows with no adapter loaded (the shared
    engine: the harness unloaded every adapter and the engine itself reports none). An engine
    whose earlier adapters still touch base rows (stale slot weights) is caught before the
    baseline is used: the baseline must match the reference first. Then, with A and B loaded,
    the base rows of a mixed batch must equal it."""
    labels = [None, "A", None, "B", None]
    reqs = lora.requests(labels)
    base_reqs = [r for r in reqs if r.adapter is None]
    engine = lora.engine
    baseline = engine.generate(base_reqs)
    lora.assert_matches_reference(baseline, lora.reference(base_reqs), base_reqs, label="no adapter loaded")
    lora.require_loaded(engine, 2)
    lora.load(engine, "A")
    lora.load(engine, "B")
    mixed = engine.generate(reqs)
    base_rows = [o for o, r in zip(mixed, reqs) if r.adapter is None]
    for i, (row, ref) in enumerate(zip(base_rows, baseline)):
        assert_logprobs_close(row, ref, lora.same_engine_tolerance, label=f"base row {i} vs the run with no adapter loaded", decode=lora.decode)


# Adapters on embed_tokens or lm_head alone (as adapter_semantics judges them one at a time), here
# beside linear-only adapters and base rows: loaded after a linear-only adapter and first met in
# the batch after its rows, so an engine that gives slots in load or batch order holds them in a
# slot other than the first; an engine that reads these modules' LoRA from the first slot's
# weights is right only where the adapter is alone.
EMBEDDING_SPECS = {"embed_tokens": {"seed": 71, "targets": "embed_tokens"},
                   "lm_head": {"seed": 72, "targets": "lm_head", "b_std": 0.15}}


@pytest.mark.feature("mixed_batch/embedding_and_lm_head_adapters_beside_others",
                      "embed_tokens and lm_head adapters in a mixed batch, in slots other than the first")
@pytest.mark.parametrize("module", list(EMBEDDING_SPECS))
def test_embedding_and_lm_head_adapters_beside_others(lora, device, dtype, module):
    from lora_conformance.adapters import AdapterSpec

    lora.require(module)
    engine = lora.engine
    lora.require_loaded(engine, 3)
    specs = {"A": "A", "E": AdapterSpec(**EMBEDDING_SPECS[module]), "B": "B"}
    for name, ref in specs.items():  # load order: A, then E, then B
        lora.load(engine, name, ref)
    labels = ["A", "E", None, "B", "E", "A", None, "E", "B"]
    lora.assert_conforms(engine, labels, specs, label=f"{module} beside A, B and base rows")


# Adapters of different target sets in one batch: an engine that decides once per batch which layers
# apply LoRA (from one row's adapter, or the first slot's) is right only where the batch's adapters
# target the same modules, as in every other mixed-batch test.
TARGET_MIX = {"Tqv": {"seed": 131, "targets": "qv"}, "Tmlp": {"seed": 132, "targets": "mlp"},
              "Tattn": {"seed": 133, "targets": "attention"}}


@pytest.mark.feature("mixed_batch/different_target_sets_in_one_batch",
                      "adapters of different target modules (q/v, MLP, attention) in one batch, each row its own")
def test_different_target_sets_in_one_batch(lora, device, dtype):
    from lora_conformance.adapters import AdapterSpec

    engine = lora.engine
    lora.require_loaded(engine, len(TARGET_MIX))
    specs = {name: AdapterSpec(**spec) for name, spec in TARGET_MIX.items()}
    for name, spec in specs.items():
        lora.load(engine, name, spec)
    labels = ["Tmlp", "Tqv", None, "Tattn", "Tqv", "Tmlp", "Tattn", None, "Tqv", "Tattn", "Tmlp", "Tqv"]
    lora.assert_conforms(engine, labels, specs, label="q/v, MLP and attention adapters in one batch")


def _distinct_specs(n, rank=8):
    from lora_conformance.adapters import AdapterSpec

    return {f"S{i}": AdapterSpec(seed=100 + i, rank=rank) for i in range(n)}


@pytest.mark.feature("mixed_batch/slot_saturation", "as many distinct adapters in one batch as the engine has slots")
def test_slot_saturation(lora, device, dtype):
    """As many distinct adapters active in one batch as the engine has slots, plus base rows. The
    full profile asks for its slots (32 in one batch, 64 loaded: models/profiles.py) and serves
    two batches of 32 distinct adapters each, every one of the 64 loaded in turn."""
    from lora_conformance.models import profiles

    profile = profiles.active(lora.harness.settings)
    if profile.batch_adapters:
        engine = lora.engine_with(max_loras_per_batch=profile.batch_adapters,
                                  max_loaded_loras=profile.loaded_adapters)
    else:
        engine = lora.engine
    per_batch = min(engine.limits.max_loras_per_batch, engine.limits.max_loaded_loras)
    loaded = max(per_batch, min(profile.loaded_adapters, engine.limits.max_loaded_loras))
    specs = _distinct_specs(loaded)
    for name, spec in specs.items():
        lora.load(engine, name, spec)
    names = list(specs)
    for start in range(0, loaded, per_batch):
        group = names[start:start + per_batch]
        # fast profile: each adapter twice; full: each once (32 rows of adapters and 2 base rows)
        labels = group * (1 if profile.batch_adapters else 2) + [None, None]
        lora.assert_conforms(engine, labels, {n: specs[n] for n in group},
                             label=f"saturated: {len(group)} distinct adapters (of {loaded} loaded)")


@pytest.mark.feature("mixed_batch/more_adapters_than_slots",
                      "more adapters in one call than device slots", requires=("max_loaded",))
def test_more_adapters_than_slots(lora, device, dtype):
    """More adapters in one call than device slots: the engine must split or queue, never mis-route.
    The shared capacity's two slots per batch and four held: four adapters, twice the slots, all held."""
    engine = lora.capacity_engine()
    specs = _distinct_specs(lora.CAPACITY["max_loaded_loras"])
    for name, spec in specs.items():
        lora.load(engine, name, spec)
    labels = ["S0", "S1", None, "S2", "S3", "S1", None, "S0", "S3", "S1", "S2", "S0"]
    lora.assert_conforms(engine, labels, specs, label="oversubscribed")


LARGE_BATCH = 48


@pytest.mark.feature("mixed_batch/large_batch_matches_isolated_references",
                      f"a batch of {LARGE_BATCH} requests (three adapters and the base mixed) decodes every row as its "
                      "isolated reference")
def test_large_batch_matches_isolated_references(lora, device, dtype):
    """Users serve dozens of requests at once, and engines change kernels, index buffers and graph
    buckets with the batch size; the other mixed-batch tests decode a dozen rows at most. Here
    every decode step holds 48 rows: their adapters drawn (seeded) from A, B, C and the base, the
    16 prompts three times over, so a row that takes another row's adapter past any batch-size
    threshold differs from its own reference."""
    engine = lora.engine
    lora.require_loaded(engine, 3)
    for name in ("A", "B", "C"):
        lora.load(engine, name)
    rng = random.Random(LARGE_BATCH)
    labels = [rng.choice(["A", "B", "C", None]) for _ in range(LARGE_BATCH)]
    reqs = lora.requests(labels)
    lora.assert_matches_reference(engine.generate(reqs), lora.reference(reqs), reqs,
                                  label=f"a batch of {LARGE_BATCH} rows")


@pytest.mark.feature("mixed_batch/batch_size_invariance", "a request's output does not depend on the batch around it")
def test_batch_size_invariance(lora, device, dtype):
    """Every request of a batch of eight gives what it gives alone."""
    engine = lora.engine
    lora.load(engine, "A")
    lora.load(engine, "B")
    crowd = lora.requests(["B", None, "A", "A", None, "B", "A", None])
    batched = engine.generate(crowd)
    for i, (req, row) in enumerate(zip(crowd, batched)):
        alone = engine.generate([req])[0]
        assert_logprobs_close(row, alone, lora.same_engine_tolerance, label=f"row {i} (adapter={req.adapter or 'base'}) in a "
                              "batch of 8 vs alone", decode=lora.decode)


@pytest.mark.feature("mixed_batch/order_invariance", "reversing a batch does not change any request's output")
def test_order_invariance(lora, device, dtype):
    engine = lora.engine
    for name in ("A", "B"):
        lora.load(engine, name)
    reqs = lora.requests(["A", None, "B", "A", None, "B"])
    forward = engine.generate(reqs)
    backward = engine.generate(list(reversed(reqs)))[::-1]
    for i, (a, b) in enumerate(zip(forward, backward)):
        assert_logprobs_close(b, a, lora.same_engine_tolerance, label=f"request {i}, reversed batch", decode=lora.decode)


@pytest.mark.feature("mixed_batch/random_compositions",
                      "random adapter/base mixes, prompt lengths and lengths match their references")
@given(data=st.data())
def test_random_compositions(lora, device, dtype, data):
    """Random adapter/base mixes, prompt lengths and max tokens; each output vs its isolated reference."""
    engine = lora.engine
    lora.require_loaded(engine, 3)
    for name in ("A", "B", "C"):
        lora.load(engine, name)
    size = data.draw(st.integers(1, 6), label="batch size")
    labels = data.draw(st.lists(st.sampled_from(["A", "B", "C", None]), min_size=size, max_size=size), label="labels")
    words = " ".join(lora.prompts).split()
    reqs = []
    for label in labels:
        start = data.draw(st.integers(0, len(words) - 2), label="prompt start")
        length = data.draw(st.integers(1, 20), label="prompt words")
        tokens = data.draw(st.integers(1, 12), label="max new tokens")
        reqs.append(GenerationRequest(prompt=" ".join(words[start:start + length]), adapter=label, max_new_tokens=tokens))
    note("composition (one row a line):\n" + "\n".join(
        f"  row {i}: adapter={r.adapter or 'base'} max_new_tokens={r.max_new_tokens} prompt={r.prompt!r}"
        for i, r in enumerate(reqs)))
    lora.assert_matches_reference(engine.generate(reqs), lora.reference(reqs), reqs, label=f"composition {labels}")
