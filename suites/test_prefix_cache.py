"""Prefix cache: a hit equals the miss, and two adapters on one prompt never share cached entries.

Where the engine reports cached prompt tokens (``GenerationResult.cached_tokens``) each test
proves that the hit it relies on happened (a test that passes with the cache off certifies
nothing) and that another adapter's request found nothing cached; where it cannot, the test
says so in the report (``lora_note``) and judges the outputs alone.
"""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci
from lora_conformance.judge import assert_logprobs_close
from lora_conformance.types import GenerationRequest

register_cpu_ci(est_time=15, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=20, suite="per-commit")
register_npu_ci(est_time=20, suite="per-commit")

pytestmark = pytest.mark.requires("prefix_cache")

# All-linear adapters with B std 0.09 (3x the default): another adapter's cached K and V must move
# the output past bfloat16's tolerance. With the default q/v adapters an engine whose cache ignored
# the adapter passed on bfloat16 (fault prefix_cache_ignores_adapter, cpu); at 0.15 a correct
# bfloat16 engine drifts past it. The tests assert the adapters' visibility first.
SPECS = {name: AdapterSpec(seed=seed, targets="all-linear", b_std=0.09) for name, seed in (("A", 411), ("B", 412))}

# Outputs are judged against the reference at the free-running bound (``lora.free_running_tolerance``):
# strong all-linear adapters on a ~430-token prompt are outside what the strict per-step bound was
# fitted to. In bfloat16 correct engines depart from the float32 reference by up to 1.05 here (PEFT;
# the built-in engine 0.54, vLLM with the adapter merged into its weights 0.33: ci/repro/
# vllm_cpu_bf16_long_prompt.py), past the strict 0.75 and inside the free-running 2.5. Same-engine
# comparisons (a hit against its miss) keep the strict bound; visibility is asserted at the bound used.


def visible(lora, prompt):
    """Each adapter's reference on this prompt is far from the other's and from the base's."""
    reqs = [GenerationRequest(prompt=prompt, adapter=a, max_new_tokens=12) for a in SPECS]
    refs = lora.reference(reqs, SPECS)
    tol = lora.free_running_tolerance
    lora.assert_adapter_visible(refs, reqs, label="prefix-cache adapters vs base", tolerance=tol)
    swapped = [GenerationRequest(prompt=prompt, adapter=a, max_new_tokens=12) for a in reversed(list(SPECS))]
    lora.assert_adapter_visible(refs, reqs, label="prefix-cache adapters vs each other",
                                others=lora.reference(swapped, SPECS), tolerance=tol)


def assert_hit(lora, outputs, label):
    """Every output reports cached tokens > 0, or (engine cannot report) a note says the hit is unproven."""
    counts = [o.cached_tokens for o in outputs]
    if all(c is None for c in counts):
        lora.note(f"{label}: prefix-cache hit not proven (the engine does not report cached tokens)")
        return
    assert all(c for c in counts), f"{label}: no prefix-cache hit happened (cached tokens per request: {counts})"


def assert_no_hit(lora, outputs, label):
    counts = [o.cached_tokens for o in outputs]
    assert not any(counts), (f"{label}: cached KV was reused across adapters (cached tokens per request: "
                             f"{counts}); all-linear adapters change every layer's K and V")


def long_prompt(lora, i=0):
    """Several KV blocks long, so block-granular caches really hold it: about 430 tokens of the
    synthetic vocabulary, three blocks of 128 (vLLM's CPU default block size) and many of 16. A cache
    stores whole blocks only, so a prompt shorter than one block can never be a hit."""
    return " ".join((lora.prompts[i:] + lora.prompts[:i]) * 3)


@pytest.mark.feature("prefix_cache/hit_equals_miss", "a prefix-cache hit gives the miss's outputs")
def test_hit_equals_miss(lora, device, dtype):
    engine = lora.cold_engine(prefix_cache=1)
    lora.load(engine, "A", SPECS["A"])
    reqs = [GenerationRequest(prompt=long_prompt(lora), adapter=a, max_new_tokens=12) for a in ("A", None)]
    miss = engine.generate(reqs)
    hit = engine.generate(reqs)
    assert_hit(lora, hit, "second run of the same requests")
    for i, (h, m) in enumerate(zip(hit, miss)):
        assert_logprobs_close(h, m, lora.same_engine_tolerance, label=f"cache hit vs miss, request {i}", decode=lora.decode)
    lora.assert_matches_reference(hit, lora.reference(reqs, SPECS), reqs, label="cache hit",
                                  tolerance=lora.free_running_tolerance)


@pytest.mark.feature("prefix_cache/adapters_never_share_cached_entries",
                      "cached KV of one adapter is never served to another")
@pytest.mark.parametrize("order", [("A", "B", None), (None, "A", "B")])
def test_adapters_never_share_cached_entries(lora, device, dtype, order):
    """Serve one prompt under each adapter in turn: every later request must see its own adapter's KV."""
    engine = lora.cold_engine(prefix_cache=1)
    for name in ("A", "B"):
        lora.load(engine, name, SPECS[name])
    prompt = long_prompt(lora, 3)
    visible(lora, prompt)
    for k, label in enumerate(order):
        req = [GenerationRequest(prompt=prompt, adapter=label, max_new_tokens=12)]
        out = engine.generate(req)
        if k:
            assert_no_hit(lora, out, f"{label or 'base'} after {order[:k]}")
        lora.assert_matches_reference(out, lora.reference(req, SPECS), req, label=f"{label or 'base'} after {order}",
                                      tolerance=lora.free_running_tolerance)
    again = [GenerationRequest(prompt=prompt, adapter=order[0], max_new_tokens=12)]
    out = engine.generate(again)
    assert_hit(lora, out, f"{order[0] or 'base'} served again")  # the cache was on: its own entries are found
    lora.assert_matches_reference(out, lora.reference(again, SPECS), again, label=f"{order[0] or 'base'} again",
                                  tolerance=lora.free_running_tolerance)
