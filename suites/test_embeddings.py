"""Embeddings from an encoder with LoRA: normalised, changed by an adapter, stable, distinct, right."""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_xpu_ci
from lora_conformance.compare import assert_embeddings_close, cosine
from lora_conformance.compare.embeddings import norm

register_cpu_ci(est_time=10, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=10, suite="per-commit")

pytestmark = [pytest.mark.base_model("encoder"), pytest.mark.requires("embeddings")]

SPECS = {"EA": AdapterSpec(seed=401, targets="encoder_attention"), "EB": AdapterSpec(seed=402, targets="encoder_attention")}
UNIT_NORM_ATOL = 1e-2
SAME_ADAPTER_MIN_COS = 0.999
CHANGED_MAX_COS = 0.999


@pytest.fixture
def encoder(lora):
    engine = lora.engine
    for name, spec in SPECS.items():
        lora.load(engine, name, spec)
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


@pytest.mark.feature("embeddings/matches_reference",
                      "encoder embeddings with and without an adapter match the reference")
@pytest.mark.parametrize("adapter", [None, "EA", "EB"])
def test_matches_reference(lora, encoder, device, dtype, adapter):
    ref_runner = lora.harness.reference(lora.model_dir)
    path = None if adapter is None else lora.adapter_path(SPECS[adapter])
    assert_embeddings_close(encoder.embed(lora.prompts, adapter), ref_runner.embed(lora.prompts, path),
                            lora.tolerance.embedding_cos_min, label=f"adapter={adapter}")


MIXED = ["EA", None, "EB", "EB", "EA", None]


@pytest.mark.feature("embeddings/mixed_adapters_in_one_batch",
                      "texts with different adapters (and none) in one embed call each get their own adapter",
                      requires=("mixed_batch",))
def test_mixed_adapters_in_one_batch(lora, encoder, device, dtype):
    """One embed call, one adapter per text: each embedding matches its own adapter's reference and
    is nearer to it than to the same text's reference under the batch's other adapters."""
    texts = lora.prompts[: len(MIXED)]
    ref_runner = lora.harness.reference(lora.model_dir)
    refs = {a: ref_runner.embed(texts, None if a is None else lora.adapter_path(SPECS[a])) for a in (None, *SPECS)}
    outs = encoder.embed(texts, MIXED)
    assert len(outs) == len(texts), f"{len(outs)} embeddings for {len(texts)} texts"
    for i, (out, own) in enumerate(zip(outs, MIXED)):
        label = f"text {i} (adapter={own or 'base'}) in the mixed batch {MIXED}"
        assert_embeddings_close([out], [refs[own][i]], lora.tolerance.embedding_cos_min, label=label)
        cos = {a or "base": cosine(out, refs[a][i]) for a in refs}
        nearest = max(cos, key=cos.get)
        assert nearest == (own or "base"), (f"{label}: nearest reference is {nearest}'s, not its own; "
                                            f"cosines {', '.join(f'{k} {v:.6f}' for k, v in cos.items())}")
