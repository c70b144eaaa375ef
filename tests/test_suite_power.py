"""A suite test that cannot see its adapter is a defect: ``lora.assert_adapter_visible`` fails it.

Found on bfloat16: ``adapter_semantics::lm_head``'s adapter moved the reference by less than the
dtype's tolerance, so an engine dropping lm_head LoRA passed it (fault ``lm_head_dropped`` on an H200).
The suites' adapter checks now assert their own power first; these tests pin the guard itself.
"""

POWER_SUITE = '''
import pytest
from lora_conformance.adapters import AdapterSpec


def _refs(lora, spec):
    reqs = lora.requests(["x"] * 2, prompts=lora.prompts[:2], max_new_tokens=4)
    return lora.reference(reqs, {"x": spec}), reqs


def test_zero_adapter_is_invisible(lora):
    refs, reqs = _refs(lora, AdapterSpec(seed=5, zero=True))
    with pytest.raises(AssertionError, match="could not tell an engine that ignores them"):
        lora.assert_adapter_visible(refs, reqs, label="zero")


def test_all_linear_adapter_is_visible(lora):
    refs, reqs = _refs(lora, AdapterSpec(seed=6, targets="all-linear"))
    lora.assert_adapter_visible(refs, reqs, label="all-linear")

'''


def test_power_guard(suite_runner, lora_settings):
    suite_runner.makepyfile(test_power=POWER_SUITE)
    result = suite_runner.runpytest("--device=cpu", "--dtype=float32", f"--lora-cache={lora_settings.cache_dir}",
                                    "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)
