"""Structured facts in the report: the feature marker, not-certified outcomes and failure types
travel from the plugin (user properties) into report.json, and verify uses them; records written
before they existed still verify by node id and skip text."""

from __future__ import annotations

import json

from lora_conformance.judge.verdict import classify, verify

SUITE = '''
import pytest
from lora_conformance.outcomes import LIMIT, not_certified

@pytest.mark.feature("routing/base_rows_stay_base", "base rows get no adapter delta")
def test_function_name_is_not_the_id():
    assert 1 == 2, "base row got a delta"

@pytest.mark.feature("routing/many_slots", "as many adapters as slots")
def test_limit():
    not_certified(LIMIT, "needs 9 slots, engine allows 4")

@pytest.mark.feature("routing/text_only", "a plain skip that only looks like one")
def test_text_only():
    pytest.skip("not certified: said in text only")

@pytest.mark.feature("routing/recorded_bug", "a recorded engine bug")
@pytest.mark.xfail(reason="engine bug #7", strict=True)
@pytest.mark.parametrize("n", [1, 2])
def test_xfail(n):
    raise RuntimeError(f"EngineCore died at step {n} in /tmp/x{n}/core.py")
'''


def test_report_records_feature_outcome_and_failure(pytester, tmp_path):
    d = pytester.mkdir("suites")
    (d / "test_routing.py").write_text(SUITE)
    out = tmp_path / "report"
    result = pytester.runpytest("suites", "--engine=builtin", "--device=cpu", f"--lora-report={out}",
                                "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=2, xfailed=2)
    data = json.loads((out / "report.json").read_text())
    records = {r["nodeid"].split("::")[1]: r for r in data["records"]}
    assert records["test_function_name_is_not_the_id"]["feature"] == {
        "id": "routing/base_rows_stay_base", "description": "base rows get no adapter delta"}
    assert records["test_function_name_is_not_the_id"]["failure"]["type"] == "AssertionError"
    assert records["test_limit"]["outcome"] == {"status": "not certified", "cause": "limit",
                                                "detail": "needs 9 slots, engine allows 4"}
    assert records["test_text_only"]["outcome"] is None
    assert records["test_xfail[1]"]["failure"]["type"] == "RuntimeError"

    features = data["verdict"]["features"]
    assert {f: v["status"] for f, v in features.items()} == {
        "routing/base_rows_stay_base": "failed", "routing/many_slots": "not certified",
        "routing/text_only": "skipped", "routing/recorded_bug": "xfail"}
    assert features["routing/base_rows_stay_base"]["description"] == "base rows get no adapter delta"
    cases = {c["nodeid"].split("::")[1]: c for c in data["verdict"]["cases"]}
    assert cases["test_limit"]["cause"] == "limit"

    causes = data["verdict"]["root_causes"]
    assert [(c["signature"], c["features"], c["statuses"]) for c in causes] == [
        ("AssertionError: base row got a delta", ["routing/base_rows_stay_base"], {"failed": 1}),
        ("RuntimeError: EngineCore died at step <n> in <path>", ["routing/recorded_bug"], {"xfail": 2}),
    ]
    assert data["verdict"]["summary"]["root_causes"] == 2
    md = (out / "report.md").read_text()
    assert md.index("## Root causes: 2 root causes (1 with unexpected failures, 1 recorded as xfail only)") \
        < md.index("## Features")
    assert "| `routing/base_rows_stay_base` | base rows get no adapter delta | ❌ failed |" in md
    result.stdout.fnmatch_lines(["*LoRA conformance*", "2 root causes (1 with unexpected failures, 1 recorded as xfail only)",
                                 "  1. AssertionError: base row got a delta [1 failed]: routing/base_rows_stay_base"])


def test_old_records_fall_back_to_node_id_and_skip_text():
    """Schema-1 records are read by report.legacy: a not-certified skip told by its text gets its
    outcome there; every other reader sees only structured outcomes."""
    from lora_conformance.report.legacy import upgrade_record

    old = {"nodeid": "suites/test_lifecycle.py::test_pinning[cpu-float32]", "phases": {"setup": "skipped"},
           "wasxfail": None, "skip_reason": "not certified: engine does not declare pinning", "message": None,
           "repro": None}
    assert classify(upgrade_record(old)) == ("not certified", "not certified: engine does not declare pinning")
    # A new record says so structurally: the same text without an outcome is a neutral skip.
    assert classify({**upgrade_record(old), "outcome": None})[0] == "skipped"
    assert classify({**upgrade_record(old), "outcome": {"status": "not certified", "cause": "capability",
                                                         "detail": "x"}})[0] == "not certified"
    v = verify([upgrade_record(old), upgrade_record({
        **old, "nodeid": "suites/test_lifecycle.py::test_renamed[cpu-float32]",
        "feature": {"id": "lifecycle/pinning", "description": "pinning"}})])
    assert set(v.features) == {"lifecycle/pinning"}
    assert v.features["lifecycle/pinning"].description == "pinning"
