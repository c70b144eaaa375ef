"""verify(records) -> Verdict: classification rules, aggregation, purity, badge score."""

from __future__ import annotations

import copy
import json
import random

import pytest

from lora_conformance.report.badge import badge_svg, badge_text
from lora_conformance.features import feature_of
from lora_conformance.judge.verdict import aggregate, classify, verify


def rec(nodeid, phases, **extra):
    return {"nodeid": nodeid, "phases": phases, "wasxfail": None, "skip_reason": None, "message": None,
            "evidence": None, "duration": 0.5, **extra}


OK = {"setup": "passed", "call": "passed", "teardown": "passed"}
RECORDS = [
    rec("suites/test_mixed_batch.py::test_nearest_reference_routing[cpu-float32-2]", OK),
    rec("suites/test_mixed_batch.py::test_nearest_reference_routing[cpu-float32-4]",
        {"setup": "passed", "call": "failed", "teardown": "passed"}, message="slot 1 expected 'a'",
        evidence={"check": "nearest_reference_routing", "rows": []}),
    rec("suites/test_pinning.py::test_pinned_adapter_survives", {"setup": "skipped", "teardown": "passed"},
        skip_reason="not certified: engine does not declare pinning",
        outcome={"status": "not certified", "cause": "capability", "detail": "engine does not declare pinning"}),
    rec("suites/test_graphs.py::test_graph_replay", {"setup": "skipped", "teardown": "passed"},
        skip_reason="not applicable on cpu"),
    rec("suites/test_dora.py::test_dora_matches", {"setup": "passed", "call": "skipped", "teardown": "passed"},
        wasxfail="engine bug #41"),
    rec("suites/test_dora.py::test_dora_rank", OK),
    rec("suites/test_loading.py::test_reload", {"setup": "failed", "teardown": "passed"}, message="RuntimeError: x"),
    rec("suites/test_loading.py::TestGroup::test_unload[a]", OK, wasxfail="flaky"),
]


def test_feature_of():
    assert feature_of("suites/test_mixed_batch.py::test_nearest_reference_routing[cpu-bfloat16]") == (
        "mixed_batch", "mixed_batch/nearest_reference_routing")
    assert feature_of("suites/sub/test_x.py::TestGroup::test_y[a::b]") == ("x", "x/y")
    assert feature_of("suites/test_x.py") == ("x", "x/(collection)")


@pytest.mark.parametrize("record, expected", [
    (RECORDS[0], ("passed", "")),
    (RECORDS[1], ("failed", "slot 1 expected 'a'")),
    (RECORDS[2], ("not certified", "not certified: engine does not declare pinning")),
    (RECORDS[3], ("skipped", "not applicable on cpu")),
    (RECORDS[4], ("xfail", "engine bug #41")),
    (RECORDS[6], ("error", "error in setup: RuntimeError: x")),
    (RECORDS[7], ("passed", "XPASS: flaky")),
    (rec("t.py::test_a", {"setup": "passed", "call": "passed", "teardown": "failed"}, message="leak"),
     ("error", "error in teardown: leak")),
    (rec("t.py::test_a", {"setup": "passed"}), ("error", "incomplete: the test did not finish (interrupted or crashed worker)")),
    (rec("t.py", {"collect": "failed"}, message="ImportError: y"), ("error", "error in collect: ImportError: y")),
])
def test_classify(record, expected):
    assert classify(record) == expected


def test_aggregate_order():
    assert aggregate(["passed", "failed", "xfail"]) == "failed"
    assert aggregate(["passed", "error"]) == "error"
    assert aggregate(["passed", "xfail", "skipped"]) == "xfail"
    assert aggregate(["passed", "not certified", "skipped"]) == "passed"
    assert aggregate(["not certified", "not certified"]) == "not certified"
    assert aggregate(["not certified", "skipped"]) == "not certified"
    assert aggregate(["skipped"]) == "skipped"
    assert aggregate([]) == "skipped"


def test_verdict():
    v = verify(RECORDS)
    assert {f: feat.status for f, feat in v.features.items()} == {
        "dora/dora_matches": "xfail",
        "dora/dora_rank": "passed",
        "graphs/graph_replay": "skipped",
        "loading/reload": "error",
        "loading/unload": "passed",
        "mixed_batch/nearest_reference_routing": "failed",
        "pinning/pinned_adapter_survives": "not certified",
    }
    routing = v.features["mixed_batch/nearest_reference_routing"]
    assert routing.counts["passed"] == 1 and routing.counts["failed"] == 1
    assert routing.reason == "slot 1 expected 'a'"
    assert v.suites["dora"]["xfail"] == 1 and v.suites["dora"]["passed"] == 1
    assert v.score() == (2, 6)  # the skipped feature is not counted
    assert v.certified is False
    assert v.summary["cases"] == 8


def test_certified_needs_a_pass_and_no_failure():
    assert verify([RECORDS[0], RECORDS[2], RECORDS[3]]).certified is True
    assert verify([RECORDS[2], RECORDS[3]]).certified is False  # nothing shown to work
    assert verify([]).score() == (0, 0)


def test_verify_is_pure():
    before = copy.deepcopy(RECORDS)
    first = verify(RECORDS).as_dict()
    assert RECORDS == before  # inputs untouched
    shuffled = RECORDS[:]
    random.Random(3).shuffle(shuffled)
    assert verify(shuffled).as_dict() == first  # order of records does not matter
    # The verdict survives a JSON round trip of the records (re-verification of a stored report).
    assert verify(json.loads(json.dumps(RECORDS))).as_dict() == first
    assert json.loads(json.dumps(first)) == first


def test_badge():
    v = verify(RECORDS)
    assert badge_text(v, "xpu") == ("LoRA conformance · xpu", "2/6")
    svg = badge_svg(v, "xpu")
    assert svg.startswith("<svg") and "2/6" in svg and "#c62828" in svg  # red: a failure
    assert "#2e7d32" in badge_svg(verify([RECORDS[0], RECORDS[3]]), "cpu")  # green: all counted pass
    assert "#b58900" in badge_svg(verify([RECORDS[0], RECORDS[2]]), "cpu")  # yellow: not everything certified
