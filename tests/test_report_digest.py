"""report.json is tamper-evident: its digest covers the environment, the selection, the records and
the verdict, so render, merge and verify refuse a relabelled or edited report (exit 3, a message
naming the file) unless --ignore-digest, even when the records' own checksum was recomputed; a field
of the wrong JSON type is a format error naming it (exit 2), never a traceback. Schema-1 reports
(the stored ones in reports/) are still read, and verify says what their checksum does not cover."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from lora_conformance.report import cli as report_cli
from lora_conformance.report import legacy
from lora_conformance.report.document import SCHEMA, build_report, canonical_bytes, report_digest, write_report

RECORDS = [
    {"nodeid": "suites/test_accuracy.py::test_single_adapter_matches_reference[A]",
     "phases": {"setup": "passed", "call": "failed", "teardown": "passed"}, "message": "slot 0 wrong",
     "duration": 1.5},
    {"nodeid": "suites/test_lifecycle.py::test_load_unload_reload",
     "phases": {"setup": "passed", "call": "passed", "teardown": "passed"}, "duration": 0.5},
]
ENV = {"engine": {"name": "builtin", "args": {}}, "device": {"type": "cpu", "name": "cpu"}, "dtype": "float32"}
SELECTION = {"args": ["suites", "-k", "accuracy or lifecycle"], "paths": ["suites"], "keyword": "accuracy or lifecycle",
             "deselected": {}, "declared_features": ["accuracy/single_adapter_matches_reference",
                                                     "lifecycle/load_unload_reload"],
             "suite": {"files": {"suites/test_accuracy.py": "ab"}, "sha256": "cd", "version": "0.1.0"}}
REPO = Path(__file__).resolve().parents[1]


def _cli(*argv):
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    return report_cli.run(parser.parse_args([str(a) for a in argv]))


@pytest.fixture
def report(tmp_path):
    out = tmp_path / "run"
    write_report(build_report(ENV, RECORDS, SELECTION), out)
    return out / "report.json"


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_written_report_carries_the_digest_and_verifies(report, capsys):
    data = json.loads(report.read_text())
    assert data["schema"] == SCHEMA
    assert data["digest"] == report_digest(data) == {"sha256": hashlib.sha256(canonical_bytes(data)).hexdigest()}
    assert _cli("verify", report) == 0
    assert "digest ok (covers environment, selection, records and verdict)" in capsys.readouterr().out


def test_canonical_bytes_cover_everything_but_digest_and_signature(report):
    data = json.loads(report.read_text())
    base = canonical_bytes(data)
    assert canonical_bytes({**data, "digest": {"sha256": "0"}, "signature": {"key": "x"}}) == base
    for key in ("environment", "selection", "records", "verdict", "schema"):
        assert canonical_bytes({**data, key: "changed"}) != base, key
    # Key order and whitespace of the file do not matter: the bytes are canonical.
    assert canonical_bytes(json.loads(json.dumps(data, indent=3))) == base


def _turn_failed_into_passed(data):
    data["records"][0]["phases"]["call"] = "passed"
    data["records"][0]["message"] = None


def _relabel(data):
    data["environment"]["engine"]["name"] = "vllm"
    data["environment"]["device"] = {"type": "cuda", "name": "cuda:0", "device_name": "NVIDIA H200"}


def _recompute_records_checksum(data):
    _turn_failed_into_passed(data)
    data["records_digest"] = legacy.records_digest(data["records"])  # what a schema-1 reader checked


@pytest.mark.parametrize("change", [_turn_failed_into_passed, _relabel, _recompute_records_checksum,
                                    lambda d: d["selection"].__setitem__("keyword", None),
                                    lambda d: d["verdict"]["summary"].__setitem__("certified", True)],
                         ids=["records", "relabelled", "records-checksum-recomputed", "selection", "verdict"])
@pytest.mark.parametrize("action", ["render", "merge", "verify"])
def test_edited_reports_are_refused(report, tmp_path, capsys, action, change):
    _edit(report, change)
    args = {"render": ("render", report, "-o", tmp_path / "o"), "merge": ("merge", report, "-o", tmp_path / "o"),
            "verify": ("verify", report)}[action]
    assert _cli(*args) == report_cli.DIGEST_EXIT
    err = capsys.readouterr().err
    assert str(report) in err and "does not match its digest" in err and "--ignore-digest" in err, err
    assert not (tmp_path / "o").exists(), "nothing written from a refused report"


def test_ignore_digest_reads_an_edited_report_and_verify_tells_the_verdict_apart(report, tmp_path, capsys):
    _edit(report, _turn_failed_into_passed)
    # The stored verdict (failed) is not what these records give: verify says so (exit 1).
    assert _cli("verify", report, "--ignore-digest") == 1
    assert _cli("render", report, "-o", tmp_path / "o", "--ignore-digest") == 0
    # What is rendered from an unchecked report says so, under its new digest.
    capsys.readouterr()
    assert _cli("verify", tmp_path / "o") == 0
    assert "digest ok, but rendered with --ignore-digest" in capsys.readouterr().out
    assert "rendered with --ignore-digest" in (tmp_path / "o" / "report.md").read_text()


def test_report_without_digest_is_refused_unless_ignored(report, tmp_path, capsys):
    _edit(report, lambda d: d.pop("digest"))
    assert _cli("render", report, "-o", tmp_path / "o") == report_cli.DIGEST_EXIT
    assert "no digest" in capsys.readouterr().err
    assert _cli("render", report, "-o", tmp_path / "o", "--ignore-digest") == 0
    rewritten = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rewritten["digest"] == report_digest(rewritten)


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["records"].__setitem__(0, "a string"), "records[0]: expected an object"),
    (lambda d: d["records"][0].__setitem__("phases", ["call"]), "records[0].phases"),
    (lambda d: d["records"][1].__setitem__("nodeid", 7), "records[1].nodeid"),
    (lambda d: d["records"][0]["phases"].__setitem__("call", "great"), "records[0].phases"),
    (lambda d: d["records"][0].__setitem__("duration", "long"), "records[0].duration"),
    (lambda d: d["records"][0].__setitem__("failure", {"type": 3}), "records[0].failure.type"),
    (lambda d: d["records"][0].__setitem__("notes", [{"x": 1}]), "records[0].notes"),
    (lambda d: d["records"][0].__setitem__("effects", "plot"), "records[0].effects"),
    (lambda d: d["records"][0].__setitem__("surprise", 1), "unknown field(s) surprise"),
    (lambda d: d.__setitem__("records", {"a": 1}), "no 'records' list"),
    (lambda d: d.__setitem__("environment", ["cpu"]), "environment: expected an object"),
    (lambda d: d["environment"].__setitem__("engine", "vllm"), "environment.engine: expected an object"),
    (lambda d: d["environment"]["engine"].__setitem__("args", [1]), "environment.engine.args"),
    (lambda d: d["environment"]["device"].__setitem__("type", 7), "environment.device.type"),
    (lambda d: d["environment"].__setitem__("packages", {"torch": 2}), "environment.packages.torch"),
    (lambda d: d["environment"].__setitem__("dtype", {"x": 1}), "environment.dtype"),
    (lambda d: d.__setitem__("selection", "all"), "selection: expected an object"),
    (lambda d: d["selection"].__setitem__("deselected", ["a"]), "selection.deselected"),
    (lambda d: d["selection"].__setitem__("declared_features", [1]), "selection.declared_features"),
    (lambda d: d["selection"]["suite"].__setitem__("files", 3), "selection.suite.files"),
])
@pytest.mark.parametrize("action", ["render", "merge"])
def test_malformed_fields_are_format_errors(report, tmp_path, capsys, change, needle, action):
    _edit(report, change)
    for ignore in ((), ("--ignore-digest",)):
        assert _cli(action, report, "-o", tmp_path / "o", *ignore) in (2, report_cli.DIGEST_EXIT)
        err = capsys.readouterr().err
        if ignore:
            assert needle in err and "Traceback" not in err, err


def test_report_that_is_not_utf8_is_a_format_error(report, tmp_path, capsys):
    report.write_bytes(b'{"schema": "\xff"}')
    assert _cli("verify", report) == 2
    assert "not UTF-8" in capsys.readouterr().err


# ---- schema 1 -------------------------------------------------------------------------------


def _schema1(tmp_path, records, **extra):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": legacy.SCHEMA_1, "environment": ENV, "verdict": {}, "records": records,
                                "records_digest": legacy.records_digest(records), **extra}))
    return path


def test_schema1_is_read_by_its_own_function_and_says_what_is_not_covered(tmp_path, capsys):
    old = [{**RECORDS[1], "repro": None},
           {"nodeid": "suites/test_lifecycle.py::test_pinning", "phases": {"setup": "skipped"},
            "skip_reason": "not certified: engine does not declare pinning", "repro": None}]
    path = _schema1(tmp_path, old)
    assert _cli("verify", path) == 1  # its (empty) stored verdict is not what the records give
    out = capsys.readouterr().out
    assert "schema 1: its checksum covers the records only" in out and "digest ok" not in out
    assert "certified (selection not recorded)" in out
    assert _cli("render", path, "-o", tmp_path / "o") == 0
    rendered = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rendered["legacy"]["schema"] == 1 and rendered["selection"] is None, "rendered, it stays marked"
    statuses = {f: v["status"] for f, v in rendered["verdict"]["features"].items()}
    assert statuses == {"lifecycle/load_unload_reload": "passed", "lifecycle/pinning": "not certified"}
    md = (tmp_path / "o" / "report.md").read_text()
    assert "schema 1: its checksum covered the records only" in md and "selection | not recorded" in md


def test_schema1_with_edited_records_is_refused(tmp_path, capsys):
    path = _schema1(tmp_path, [RECORDS[1]])
    _edit(path, lambda d: d["records"][0]["phases"].__setitem__("call", "failed"))
    assert _cli("verify", path) == report_cli.DIGEST_EXIT
    assert "records do not match records_digest" in capsys.readouterr().err


# Stored reports whose digest does not match their content as committed (checked: the committed
# JSON itself fails, before compression): read with --ignore-digest, and the test keeps them failing it.
DIGEST_MISMATCH_AS_COMMITTED = {"builtin-cpu-tensor-parallel/report.json.xz"}


@pytest.mark.parametrize("stored", sorted((REPO / "reports").rglob("*.json.xz")),
                         ids=lambda p: str(p.relative_to(REPO / "reports")))
def test_stored_reports_still_verify_and_render(stored, tmp_path, capsys):
    from lora_conformance.fileio import read_report_bytes

    data = json.loads(read_report_bytes(stored)[1])
    if "records" not in data:
        pytest.skip("a report without records (a summary)")
    ignore = () if ("records_digest" in data or "digest" in data) else ("--ignore-digest",)
    if str(stored.relative_to(REPO / "reports")) in DIGEST_MISMATCH_AS_COMMITTED:
        assert _cli("verify", stored) == report_cli.DIGEST_EXIT
        capsys.readouterr()
        ignore = ("--ignore-digest",)
    assert _cli("verify", stored, *ignore) == 0, capsys.readouterr()
    assert "stored verdict matches the records" in capsys.readouterr().out
    assert _cli("render", stored, "-o", tmp_path / "o", *ignore) == 0
    assert (tmp_path / "o" / "report.html").read_text().count("<h2") >= 3
