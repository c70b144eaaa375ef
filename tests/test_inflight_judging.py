"""How the in-flight lifecycle suite judges "the change waited for the requests that use the name".

A served engine finishes those requests before it answers the unload, but the two answers travel on
connections of their own and reach the caller in either order; the base rows running beside them are
not the change's to wait for. The suite judges the requests that use the name, allowing their last
answers a few of their own steps of delivery (suites/test_inflight_lifecycle.py DELIVERY_STEPS): the
built-in engine seen through such a connection (``_defective_engines.DeliveredLate``) passes, and the
same engine with an unload that does not wait (fault ``inflight_no_drain``) still fails, on that check.
"""

from __future__ import annotations

import pytest

from _feature_runs import red_features
from lora_conformance.settings import suites_dir

CHANGES = {"inflight_lifecycle/unload_while_requests_run", "inflight_lifecycle/reload_while_requests_run"}


def _run(suite_runner, lora_settings, *engine_args):
    return suite_runner.runpytest(
        str(suites_dir() / "test_inflight_lifecycle.py"), "--engine=_defective_engines:DeliveredLate",
        *engine_args, "--device=cpu", "--dtype=float32", f"--lora-cache={lora_settings.cache_dir}",
        "-p", "no:cacheprovider", "-q")


def test_answers_delivered_after_the_change_pass(suite_runner, lora_settings):
    result = _run(suite_runner, lora_settings)
    assert red_features(result) == {}, "\n".join(result.outlines[-30:])
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("fault", ["inflight_no_drain"])
def test_a_change_that_does_not_wait_fails_through_the_same_connection(suite_runner, lora_settings, fault):
    result = _run(suite_runner, lora_settings, f"--engine-arg=fault={fault}")
    assert set(red_features(result)) == CHANGES, "\n".join(result.outlines[-30:])
    text = "\n".join(result.outlines)
    assert text.count("returned while requests using the adapter were still running") >= 2, text[-3000:]
