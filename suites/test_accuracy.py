"""Accuracy against the HF+PEFT reference: one adapter per request, every dtype, and the base model.

Adapters: the paired effect statistics at teacher-forced contexts (``lora.assert_conforms``:
effective scale, residual against the dtype's noise bound, nearest hypothesis), plus the
free-running decode check (tie-aware top-k logprobs and ROUGE-L). Prompt logprobs are asked
for only by the test that certifies them, and judged by the same paired statistics, every prompt
position a teacher-forced context (``lora.assert_prompt_logprobs_conform``).
"""

import pytest

from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_npu_ci, register_xpu_ci

register_cpu_ci(est_time=25, suite="per-commit")
register_cuda_ci(est_time=20, suite="per-commit")
register_xpu_ci(est_time=30, suite="per-commit")
register_npu_ci(est_time=30, suite="per-commit")

ADAPTERS = ("A", "B", "C", "D")


def _requests(lora, adapter, prompt_logprobs):
    return lora.requests([adapter] * len(lora.prompts), prompt_logprobs=prompt_logprobs)


@pytest.mark.feature("accuracy/base_model_matches_reference", "the base model (no adapter) matches the reference")
def test_base_model_matches_reference(lora, device, dtype):
    engine = lora.engine
    reqs = _requests(lora, None, False)
    lora.assert_matches_reference(engine.generate(reqs), lora.reference(reqs), reqs, label="base")


@pytest.mark.feature("accuracy/single_adapter_matches_reference",
                      "one default q/v adapter per request matches the reference")
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_single_adapter_matches_reference(lora, device, dtype, adapter):
    engine = lora.engine
    lora.load(engine, adapter)
    lora.assert_conforms(engine, [adapter] * 8, label=adapter)


@pytest.mark.feature("accuracy/prefill_logprobs_with_adapter",
                      "prompt logprobs with an adapter match the reference", requires=("prompt_logprobs",))
def test_prefill_logprobs_with_adapter(lora, device, dtype):
    """Adapter A on every default prompt, with prompt logprobs: the engine's effect on them (with A
    minus without, both from the engine) against the reference's, pooled over every position."""
    engine = lora.engine
    lora.load(engine, "A")
    lora.assert_prompt_logprobs_conform(engine, ["A"] * len(lora.prompts), label="prefill A")


@pytest.mark.feature("accuracy/every_dtype_matches_reference",
                      "adapter and base rows match the reference in float32, bfloat16 and float16")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_matches_reference(lora, device, dtype):
    """The same check in each dtype (the reference stays float32); 4 prompts, adapter A and base."""
    engine = lora.engine
    lora.load(engine, "A")
    lora.assert_conforms(engine, ["A", None] * 4, label=dtype)
