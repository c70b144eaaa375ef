"""Root causes: failures grouped by the bug behind them (the nearest-hypothesis diagnosis, else the
exception type + normalised message), each headed by its diagnosis or a real message, most features
first; the merged matrix lists them per column."""

from __future__ import annotations

from lora_conformance.report.merge import merge, render_matrix_markdown
from lora_conformance.judge.root_causes import headline, normalise
from lora_conformance.judge.verdict import verify


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


def test_failures_group_by_diagnosis_most_features_first():
    v = verify(RECORDS)
    got = [(c.heading, c.features, c.statuses, c.by_place) for c in v.root_causes]
    assert got == [
        # headed by a real message: its numbers are kept
        ("EngineFailure: EngineCore died (request 1, pid 9) (and 1 variant)", ["acc/x", "acc/y", "acc/z"],
         {"failed": 2, "xfail": 1}, []),
        # the comparison failure without a diagnosis, in the same suite, joins the one diagnosed cause
        ("closest to: alpha_not_over_r", ["sem/alpha", "sem/rank", "sem/other"], {"failed": 3},
         ["s/test_b.py::test_other"]),
    ], got
    other = v.root_causes[1].messages["s/test_b.py::test_other"]
    assert other == "logprobs_close: decode diff 0.7 > 0.002 at step 9", "names and numbers are not masked"
    assert headline(v.root_causes) == "2 root causes (2 with unexpected failures, 0 recorded as xfail only)"
    assert v.summary["root_causes"] == 2
    assert headline([]) == "no failures: 0 root causes"


def _effects_failure(nodeid, feature, nearest, label):
    head = f"{label}: closest to: {nearest} (adapter A)" if nearest != "correct" else \
        f"{label}: effect does not match the reference (adapter A)"
    return rec(nodeid, "failed", feature, {"type": "ConformanceAssertionError", "message": head},
               {"check": "effects", "label": label, "hypothesis": {"nearest": nearest, "adapter": "A"},
                "analyses": [{"label": "A", "nearest": nearest}, {"label": "base", "nearest": "correct"}]})


def test_one_routing_bug_is_one_root_cause_headed_by_its_diagnosis():
    """What a routing fault does to the mixed-batch suite: "served as" different adapters in different
    tests, a routing check whose slots are nearest another adapter, an effect failure whose worst
    adapter is nearest "correct" (a test hypothesis, never a root cause), a log-probability diff."""
    routing_rows = [{"slot": 0, "expected": "A", "nearest": "A", "ok": True},
                    {"slot": 1, "expected": "B", "nearest": "C", "ok": False}]
    records = [
        _effects_failure("suites/test_mixed_batch.py::test_composition[A-base-B]", "mixed_batch/composition",
                         "served as B", "A-base-B"),
        _effects_failure("suites/test_mixed_batch.py::test_composition[A-B]", "mixed_batch/composition",
                         "served as B", "A-B"),
        _effects_failure("suites/test_mixed_batch.py::test_saturation", "mixed_batch/saturation", "served as S3",
                         "saturated"),
        rec("suites/test_mixed_batch.py::test_routing[0]", "failed", "mixed_batch/routing",
            {"type": "ConformanceAssertionError", "message": "prompt 0: routing failed: slot 1 expected 'B'"},
            {"check": "nearest_reference_routing", "summary": "slot 1 expected 'B' but is nearest 'C'",
             "rows": routing_rows}),
        rec("suites/test_mixed_batch.py::test_oversubscribed", "failed", "mixed_batch/oversubscribed",
            {"type": "ConformanceAssertionError", "message": "oversubscribed: effect does not match the reference"},
            {"check": "effects", "hypothesis": {"nearest": "correct", "adapter": "S0"},
             "analyses": [{"label": "S0", "nearest": "correct"}, {"label": "S1", "nearest": "correct"}]}),
        rec("suites/test_mixed_batch.py::test_random_compositions", "failed", "mixed_batch/random_compositions",
            {"type": "ConformanceAssertionError", "message": "composition ['A', None]: slot 0: step 2"},
            {"check": "logprobs_close", "summary": "decode diff 1.73 > 0.002 at step 2"}),
        rec("suites/test_mixed_batch.py::test_order", "passed", "mixed_batch/order"),
    ]
    (cause,) = verify(records).root_causes
    assert cause.heading == ("closest to: served as B (also served as C, served as S3): "  # most frequent first
                             "rows got a wrong adapter (another one, or none)")
    assert "correct" not in cause.heading and not cause.signature.startswith("hypothesis")
    assert sorted(cause.features) == ["mixed_batch/composition", "mixed_batch/oversubscribed",
                                      "mixed_batch/random_compositions", "mixed_batch/routing", "mixed_batch/saturation"]
    assert cause.by_place == ["suites/test_mixed_batch.py::test_oversubscribed",
                              "suites/test_mixed_batch.py::test_random_compositions"]
    assert cause.messages["suites/test_mixed_batch.py::test_random_compositions"] == \
        "logprobs_close: decode diff 1.73 > 0.002 at step 2"


def test_undiagnosed_failures_elsewhere_stay_apart_and_keep_their_names():
    records = [
        _effects_failure("suites/test_mixed_batch.py::test_composition[A-B]", "mixed_batch/composition",
                         "served as B", "A-B"),
        # another suite: a diff there is not attributed to the routing bug
        rec("suites/test_accuracy.py::test_single", "failed", "accuracy/single",
            {"type": "ConformanceAssertionError", "message": "slot 0"},
            {"check": "logprobs_close", "summary": "decode diff 1.73 > 0.002 at step 2"}),
        # not a comparison: never attributed by place
        rec("suites/test_mixed_batch.py::test_slots", "failed", "mixed_batch/slots",
            {"type": "ModuleNotFoundError", "message": "No module named 'vllm'"}),
        rec("suites/test_mixed_batch.py::test_other", "failed", "mixed_batch/other",
            {"type": "ModuleNotFoundError", "message": "No module named 'sglang'"}),
    ]
    heads = [c.heading for c in verify(records).root_causes]
    assert heads == ["logprobs_close: decode diff 1.73 > 0.002 at step 2",
                     "ModuleNotFoundError: No module named 'sglang'", "ModuleNotFoundError: No module named 'vllm'",
                     "closest to: served as B: rows got a wrong adapter (another one, or none)"], heads



def test_old_records_group_by_message_and_xfail_reason():
    old = [{"nodeid": "s/test_c.py::test_a", "phases": {"call": "failed"}, "message": "RuntimeError: died at 3"},
           {"nodeid": "s/test_c.py::test_b", "phases": {"call": "failed"}, "message": "RuntimeError: died at 4"},
           {"nodeid": "s/test_c.py::test_c", "phases": {"call": "skipped"}, "wasxfail": "expected: bug 5 (https://x/5)"}]
    assert [(c.heading, c.features) for c in verify(old).root_causes] == [
        ("RuntimeError: died at 3 (and 1 variant)", ["c/a", "c/b"]), ("expected: bug 5 (https://x/5)", ["c/c"])]


def test_merged_matrix_shows_root_causes_per_column():
    env = {"engine": {"name": "e"}, "device": {"type": "cpu"}, "dtype": "float32"}
    matrix = merge([{"environment": env, "records": RECORDS}])
    (column,) = matrix["columns"]
    assert [c["heading"] for c in column["root_causes"]][:1] == ["EngineFailure: EngineCore died (request 1, pid 9) "
                                                                   "(and 1 variant)"]
    md = render_matrix_markdown(matrix)
    assert md.index("## Root causes per column") < md.index("## Features")
    assert f"### `{column['key']}` (not certified): 2 root causes" in md
    assert "1. EngineFailure: EngineCore died (request 1, pid 9) (and 1 variant) [2 failed, 1 xfail]: acc/x, acc/y, " \
        "acc/z" in md
    assert "| **root causes** | **2** |" in md
