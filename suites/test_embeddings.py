"""Embeddings from an encoder with LoRA: normalised, changed by an adapter, stable, distinct, right."""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci
from lora_conformance.judge import assert_embeddings_close, cosine
from lora_conformance.judge.embeddings import assert_embedding_effects_close
from lora_conformance.engines import EngineFailure, UnsupportedFeatureError
from lora_conformance.outcomes import REFUSED, not_certified
from lora_conformance.judge.embeddings import norm

register_cpu_ci(est_time=10, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=10, suite="per-commit")
register_npu_ci(est_time=10, suite="per-commit")

pytestmark = [pytest.mark.base_model("encoder"), pytest.mark.requires("embeddings")]

SPECS = {"EA": AdapterSpec(seed=401, targets="encoder_attention"), "EB": AdapterSpec(seed=402, targets="encoder_attention")}
UNIT_NORM_ATOL = 1e-2
SAME_ADAPTER_MIN_COS = 0.999
CHANGED_MAX_COS = 0.999


# The feature every other embeddings test builds on: an engine that declares embeddings but refuses
# to embed fails this one; the others are not certified (they would only repeat its failure).
BASIC = "embeddings/matches_reference"


@pytest.fixture
def encoder(lora, request):
    engine = lora.engine
    for name, spec in SPECS.items():
        lora.load(engine, name, spec)
    marker = request.node.get_closest_marker("feature")
    if marker is not None and marker.args[0] != BASIC:
        try:
            engine.embed(lora.prompts[:1], None)
        except (UnsupportedFeatureError, EngineFailure) as exc:
            not_certified(REFUSED, f"embed() failed ({type(exc).__name__}: {exc}); {BASIC} judges that")
    return engine


@pytest.mark.feature("embeddings/unit_norm", "embeddings are L2-normalised, with and without an adapter")
def test_unit_norm(lora, encoder, device, dtype):
    for adapter in (None, "EA"):
        for i, v in enumerate(encoder.embed(lora.prompts, adapter)):
            assert abs(norm(v) - 1.0) <= UNIT_NORM_ATOL, f"adapter={adapter} text {i}: norm {norm(v):.4f}"


@pytest.mark.feature("embeddings/lora_changes_the_embedding", "an encoder adapter changes the embedding")
def test_lora_changes_the_embedding(lora, encoder, device, dtype):
    base = encoder.embed(lora.prompts, None)
    for adapter in SPECS:
        cos = [cosine(a, b) for a, b in zip(encoder.embed(lora.prompts, adapter), base)]
        assert max(cos) < CHANGED_MAX_COS, f"{adapter}: an embedding is unchanged by the adapter (cosines {cos})"


@pytest.mark.feature("embeddings/same_adapter_is_stable",
                      "the same adapter gives the same embedding after another adapter was served")
def test_same_adapter_is_stable(lora, encoder, device, dtype):
    first = encoder.embed(lora.prompts, "EA")
    encoder.embed(lora.prompts, "EB")  # serve another adapter in between
    assert_embeddings_close(encoder.embed(lora.prompts, "EA"), first, SAME_ADAPTER_MIN_COS, label="EA twice")


@pytest.mark.feature("embeddings/distinct_adapters_differ", "two adapters give different embeddings")
def test_distinct_adapters_differ(lora, encoder, device, dtype):
    a, b = encoder.embed(lora.prompts, "EA"), encoder.embed(lora.prompts, "EB")
    cos = [cosine(x, y) for x, y in zip(a, b)]
    assert max(cos) < CHANGED_MAX_COS, f"EA and EB give the same embedding (cosines {cos})"


def _reference_effects(lora):
    ref_runner = lora.reference_runner
    base = ref_runner.embed(lora.prompts, None)
    return {n: [[x - y for x, y in zip(u, v)] for u, v in
                zip(ref_runner.embed(lora.prompts, lora.adapter_path(spec)), base)] for n, spec in SPECS.items()}


@pytest.mark.feature("embeddings/matches_reference",
                      "encoder embeddings with and without an adapter match the reference")
@pytest.mark.parametrize("adapter", [None, "EA", "EB"])
def test_matches_reference(lora, encoder, device, dtype, adapter):
    """Base: cosine to the reference. Adapters: the adapter-induced change (adapted minus base, from the
    engine) against the reference's, pooled over the texts, and nearest its own adapter's change."""
    tol = lora.tolerance
    base = encoder.embed(lora.prompts, None)
    if adapter is None:
        ref_runner = lora.reference_runner
        assert_embeddings_close(base, ref_runner.embed(lora.prompts, None), tol.embedding_cos_min, label="base")
        return
    assert_embedding_effects_close(encoder.embed(lora.prompts, adapter), base, _reference_effects(lora), adapter,
                                   tol.embedding_effect_rel_max, tol.effect_slope_margin, label=f"adapter={adapter}")


MIXED = ["EA", None, "EB", "EB", "EA", None]


@pytest.mark.feature("embeddings/mixed_adapters_in_one_batch",
                      "texts with different adapters (and none) in one embed call each get their own adapter",
                      requires=("mixed_batch",))
def test_mixed_adapters_in_one_batch(lora, encoder, device, dtype):
    """One embed call, one adapter per text: each text's adapter-induced change (against the engine's
    own base embedding) matches its adapter's reference change and is nearest it; base rows show no
    change (nearer zero than any adapter's)."""
    texts = lora.prompts[: len(MIXED)]
    outs = encoder.embed(texts, MIXED)
    assert len(outs) == len(texts), f"{len(outs)} embeddings for {len(texts)} texts"
    base = encoder.embed(texts, None)
    effects = {n: eff[: len(MIXED)] for n, eff in _reference_effects(lora).items()}
    tol = lora.tolerance
    for own in SPECS:
        rows = [i for i, a in enumerate(MIXED) if a == own]
        assert_embedding_effects_close([outs[i] for i in rows], [base[i] for i in rows],
                                       {n: [eff[i] for i in rows] for n, eff in effects.items()}, own,
                                       tol.embedding_effect_rel_max, tol.effect_slope_margin,
                                       label=f"{own} rows {rows} of the mixed batch {MIXED}")
    for i in [i for i, a in enumerate(MIXED) if a is None]:
        change = norm([x - y for x, y in zip(outs[i], base[i])])
        smallest = min(norm(eff[i]) for eff in effects.values())
        assert change < 0.5 * smallest, (f"base row {i} of the mixed batch {MIXED}: changed by {change:.3g}, "
                                         f"an adapter's change is {smallest:.3g} (an adapter leaked into it)")
