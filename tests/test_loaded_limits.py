"""Suites respect the engine's declared max_loaded_loras (context.check_loaded_limit).

A test that needs more adapters loaded at once than the engine allows is *not certified*
(cause ``limit``: "needs N loaded adapters, engine allows M"), never run past the limit where
an engine such as SGLang would fail it for the test's reason; a test about eviction past the
limit (it requires ``max_loaded``) loads as many as it needs.
"""

LIMIT_SUITE = '''
import pytest
from lora_conformance.adapters import AdapterSpec


def _load(lora, engine, n):
    for i in range(n):
        lora.load(engine, f"L{i}", AdapterSpec(seed=300 + i))


def test_within_the_limit(lora):
    _load(lora, lora.engine, 2)
    assert len(lora.engine.list_adapters()) == 2


def test_one_load_past_the_limit(lora):
    _load(lora, lora.engine, 3)


def test_declares_its_need_up_front(lora):
    lora.require_loaded(lora.engine, 5)
    raise AssertionError("not reached: 5 > max_loaded_loras=2")


@pytest.mark.feature("limits/eviction_past_the_limit", "loads past max_loaded_loras on purpose", requires=("max_loaded",))
def test_eviction_tests_may_pass_the_limit(lora):
    _load(lora, lora.engine, 3)
    assert len(lora.engine.list_adapters()) == 3
'''


def test_tests_stay_within_max_loaded_loras(suite_runner, lora_settings):
    suite_runner.makepyfile(test_limits=LIMIT_SUITE)
    result = suite_runner.runpytest("--device=cpu", "--dtype=float32", f"--lora-cache={lora_settings.cache_dir}",
                                    "--engine-arg", "max_loras_per_batch=2", "--engine-arg", "max_loaded_loras=2",
                                    "-p", "no:cacheprovider", "-q", "-rs")
    result.assert_outcomes(passed=2, skipped=2)
    out = result.stdout.str()
    assert "not certified: needs 3 loaded adapters, engine allows 2" in out
    assert "not certified: needs 5 loaded adapters, engine allows 2" in out
    reports = {r.nodeid.split("::")[-1]: r for r in result.reprec.getreports("pytest_runtest_logreport")
               if r.when == "call" or r.skipped}
    assert reports["test_one_load_past_the_limit"].skipped and reports["test_declares_its_need_up_front"].skipped


def test_the_skip_is_a_limit_outcome():
    import pytest

    from lora_conformance.context import check_loaded_limit
    from lora_conformance.outcomes import LIMIT, NotCertified

    class Engine:
        class limits:
            max_loaded_loras = 3

    check_loaded_limit(Engine, 3)
    check_loaded_limit(Engine, 9, evicting=True)
    with pytest.raises(NotCertified) as info:
        check_loaded_limit(Engine, 4)
    assert (info.value.cause, info.value.detail) == (LIMIT, "needs 4 loaded adapters, engine allows 3")


REFUSING_ENGINE = '''
from lora_conformance.engines.base import UnsupportedFeatureError
from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine


class RefusesTwoLoaded(BuiltinEngine):
    def __init__(self, model_dir, device, dtype, args):
        if args.get("max_loaded_loras") == "2":
            raise UnsupportedFeatureError("max_loaded_loras should be greater than or equal to max_loras_per_batch")
        super().__init__(model_dir, device, dtype, args)
'''

REFUSAL_SUITE = '''
def test_refused_configuration(lora):
    lora.fresh_engine(max_loras_per_batch=2, max_loaded_loras=2)
    raise AssertionError("not reached")


def test_accepted_configuration(lora):
    assert lora.fresh_engine(max_loras_per_batch=2, max_loaded_loras=3).limits.max_loaded_loras == 3
'''


def test_a_refused_configuration_is_not_certified(suite_runner, lora_settings):
    suite_runner.makepyfile(refusing_engine=REFUSING_ENGINE, test_refusal=REFUSAL_SUITE)
    suite_runner.syspathinsert()
    result = suite_runner.runpytest("--device=cpu", "--dtype=float32", f"--lora-cache={lora_settings.cache_dir}",
                                    "--engine=refusing_engine:RefusesTwoLoaded", "-p", "no:cacheprovider", "-q", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    # Harness.create_engine turns the refusal into not certified (cause refused), with the engine's reason.
    result.stdout.fnmatch_lines(["*not certified: engine*refused to start*max_loaded_loras=2, max_loras_per_batch=2*"
                                 "max_loaded_loras should be greater than or equal*"])
