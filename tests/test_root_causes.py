"""Root causes: failures grouped by signature (exception type + normalised message, or the
nearest hypothesis of an accuracy failure), most features first; the merged matrix lists them per column."""

from __future__ import annotations

from lora_conformance.report.merge import merge, render_matrix_markdown
from lora_conformance.report.root_causes import headline, normalise
from lora_conformance.report.verify import verify


def rec(nodeid, status, feature, failure=None, evidence=None, wasxfail=None):
    phases = {"setup": "passed", "call": "failed" if status == "failed" else "passed" if status == "passed"
              else "skipped", "teardown": "passed"}
    return {"nodeid": nodeid, "phases": phases, "wasxfail": wasxfail, "skip_reason": None,
            "message": (failure or {}).get("message"), "evidence": evidence, "feature": {"id": feature, "description": ""},
            "outcome": None, "failure": failure}


def test_normalise_replaces_numbers_paths_and_ids():
    assert normalise("adapter 'rank8' of rank 8 > max 4 at /tmp/cache/ad/x_12/adapter_config.json\nmore") == \
        "adapter '<id>' of rank <n> > max <n> at <path>"
    assert normalise("request 3f2a9c01d4e5 failed: 0x7ffe1 (-1.5e-3)") == "request <id> failed: <hex> (<n>)"
    assert normalise("") == ""


DEAD = {"type": "EngineFailure", "message": "EngineCore died (request 17, pid 4242)"}
RECORDS = [
    # one engine bug behind three features, with different numbers in each message
    rec("s/test_a.py::test_x[1]", "failed", "acc/x", {"type": "EngineFailure", "message": "EngineCore died (request 1, pid 9)"}),
    rec("s/test_a.py::test_y", "failed", "acc/y", DEAD),
    rec("s/test_a.py::test_z", "xfail", "acc/z", DEAD, wasxfail="known"),
    # two accuracy failures with the same nearest hypothesis, one without a hypothesis
    rec("s/test_b.py::test_scale", "failed", "sem/alpha", {"type": "ConformanceAssertionError", "message": "slot 0 (adapter=A): step 3"},
        {"check": "logprobs_close", "summary": "decode diff 1.2 > 0.002 at step 3",
         "hypothesis": {"nearest": "alpha_not_over_r"}}),
    rec("s/test_b.py::test_scale2", "failed", "sem/rank", {"type": "ConformanceAssertionError", "message": "slot 2 (adapter=B): step 0"},
        {"check": "logprobs_close", "summary": "prefill diff 3 > 0.002 at position 4",
         "hypothesis": {"nearest": "alpha_not_over_r"}}),
    rec("s/test_b.py::test_other", "failed", "sem/other", {"type": "ConformanceAssertionError", "message": "slot 1: x"},
        {"check": "logprobs_close", "summary": "decode diff 0.7 > 0.002 at step 9"}),
    rec("s/test_b.py::test_ok", "passed", "sem/ok"),
]


def test_failures_group_by_signature_most_features_first():
    v = verify(RECORDS)
    got = [(c.signature, c.features, c.statuses) for c in v.root_causes]
    assert got == [
        ("EngineFailure: EngineCore died (request <n>, pid <n>)", ["acc/x", "acc/y", "acc/z"], {"failed": 2, "xfail": 1}),
        ("hypothesis: alpha_not_over_r", ["sem/alpha", "sem/rank"], {"failed": 2}),
        ("ConformanceAssertionError: logprobs_close: decode diff <n> > <n> at step <n>", ["sem/other"], {"failed": 1}),
    ], got
    assert headline(v.root_causes) == "3 root causes (3 with unexpected failures, 0 recorded as xfail only)"
    assert v.summary["root_causes"] == 3
    assert headline([]) == "no failures: 0 root causes"


def test_old_records_group_by_message_and_xfail_reason():
    old = [{"nodeid": "s/test_c.py::test_a", "phases": {"call": "failed"}, "message": "RuntimeError: died at 3"},
           {"nodeid": "s/test_c.py::test_b", "phases": {"call": "failed"}, "message": "RuntimeError: died at 4"},
           {"nodeid": "s/test_c.py::test_c", "phases": {"call": "skipped"}, "wasxfail": "expected: bug 5 (https://x/5)"}]
    assert [(c.signature, c.features) for c in verify(old).root_causes] == [
        ("RuntimeError: died at <n>", ["c/a", "c/b"]), ("xfail: expected: bug <n> (https://x/5)", ["c/c"])]


def test_merged_matrix_shows_root_causes_per_column():
    env = {"engine": {"name": "e"}, "device": {"type": "cpu"}, "dtype": "float32"}
    matrix = merge([{"environment": env, "records": RECORDS}])
    (column,) = matrix["columns"]
    assert [c["signature"] for c in column["root_causes"]][:1] == ["EngineFailure: EngineCore died (request <n>, pid <n>)"]
    md = render_matrix_markdown(matrix)
    assert md.index("## Root causes per column") < md.index("## Features")
    assert f"### `{column['key']}`: 3 root causes" in md
    assert "1. EngineFailure: EngineCore died (request <n>, pid <n>) [2 failed, 1 xfail]: acc/x, acc/y, acc/z" in md
    assert "| **root causes** | **3** |" in md
