"""Embeddings from an encoder with LoRA: normalised, changed by an adapter, stable, distinct, right."""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci
from lora_conformance.compare import assert_embeddings_close, cosine
from lora_conformance.compare.embeddings import norm

register_cpu_ci(est_time=10, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=10, suite="per-commit")
register_npu_ci(est_time=10, suite="per-commit")

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
