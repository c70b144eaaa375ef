"""Structured not-certified outcomes reach the verdict: a NotCertified skip (refused start, too
small a limit) is "not certified" by its recorded outcome, and in a schema-1 record (no outcome)
however pytest wrote its reason; an engine that declares fewer logprobs per token than the paired
check needs is not certified by it, not judged."""

from __future__ import annotations

import pytest

from lora_conformance.judge import paired
from lora_conformance.engines import Limits
from lora_conformance.outcomes import LIMIT, NotCertified
from lora_conformance.report.legacy import upgrade_record
from lora_conformance.judge.verdict import NOT_CERTIFIED, SKIPPED, classify


def _skipped(reason: str) -> dict:
    """A schema-1 record: the skip's text is all it has."""
    return upgrade_record({"nodeid": "suites/test_moe.py::test_x[cpu-float32]", "phases": {"setup": "skipped"},
                           "skip_reason": reason, "wasxfail": None, "message": None})


def test_recorded_outcome_decides_not_the_text():
    exc = NotCertified(LIMIT, "needs 3 top-k logprobs, engine allows 1")
    record = {"nodeid": "suites/test_moe.py::test_x[cpu-float32]", "phases": {"setup": "skipped"},
              "skip_reason": str(exc), "outcome": exc.as_dict()}
    assert classify(record)[0] == NOT_CERTIFIED
    assert classify({**record, "outcome": None})[0] == SKIPPED


@pytest.mark.parametrize("reason", [
    "lora_conformance.outcomes.NotCertified: not certified: engine 'openvino' refused to start (moe): no",
    "not certified: needs 3 top-k logprobs, engine allows 1",
    "lora_conformance.outcomes.NotCertified: not certified: engine does not declare moe",
])
def test_not_certified_skips_count_as_not_certified(reason):
    status, shown = classify(_skipped(reason))
    assert status == NOT_CERTIFIED, (status, reason)
    assert shown == reason


def test_other_skips_stay_neutral():
    status, _ = classify(_skipped("not applicable: the engine's max_rank 256 is the largest rank synthesized"))
    assert status == SKIPPED, status


class _TopOneEngine:
    limits = Limits(max_loras_per_batch=1, max_loaded_loras=8, max_rank=64, max_top_k=1)

    def generate(self, requests):  # pragma: no cover - must not be reached
        raise AssertionError("the paired check must not query an engine it cannot judge")


def test_paired_check_needs_enough_logprobs_per_token():
    plan = paired.Plan([None], ["a prompt"], {}, {})
    with pytest.raises(NotCertified) as exc:
        paired.run(plan, _TopOneEngine(), runner=None, tol=None)
    assert exc.value.cause == LIMIT, exc.value.cause
    assert f"needs {paired.MIN_COMMON_IDS}" in exc.value.detail and "allows 1" in exc.value.detail, exc.value.detail
