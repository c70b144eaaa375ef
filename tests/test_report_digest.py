"""report.json is tamper-evident: render, merge and verify refuse records that do not match the
records digest (exit 3, a message naming the file) unless --ignore-digest; a malformed record
is a format error naming the record and field (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import json

import pytest

from lora_conformance.report import cli as report_cli
from lora_conformance.report.document import build_report, records_digest, write_report

RECORDS = [
    {"nodeid": "suites/test_accuracy.py::test_single_adapter_matches_reference[A]",
     "phases": {"setup": "passed", "call": "failed", "teardown": "passed"}, "message": "slot 0 wrong",
     "duration": 1.5},
    {"nodeid": "suites/test_lifecycle.py::test_load_unload_reload",
     "phases": {"setup": "passed", "call": "passed", "teardown": "passed"}, "duration": 0.5},
]


def _cli(*argv):
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    return report_cli.run(parser.parse_args([str(a) for a in argv]))


@pytest.fixture
def report(tmp_path):
    out = tmp_path / "run"
    write_report(build_report({"engine": {"name": "builtin"}, "device": {"type": "cpu"}}, RECORDS), out)
    return out / "report.json"


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_written_report_carries_the_digest_and_verifies(report, capsys):
    data = json.loads(report.read_text())
    assert data["records_digest"] == records_digest(data["records"])
    assert _cli("verify", report) == 0
    assert "records digest ok" in capsys.readouterr().out


def _turn_failed_into_passed(data):
    data["records"][0]["phases"]["call"] = "passed"
    data["records"][0]["message"] = None


@pytest.mark.parametrize("action", ["render", "merge", "verify"])
def test_edited_records_are_refused(report, tmp_path, capsys, action):
    _edit(report, _turn_failed_into_passed)
    args = {"render": ("render", report, "-o", tmp_path / "o"), "merge": ("merge", report, "-o", tmp_path / "o"),
            "verify": ("verify", report)}[action]
    assert _cli(*args) == report_cli.DIGEST_EXIT
    err = capsys.readouterr().err
    assert str(report) in err and "records do not match records_digest" in err and "--ignore-digest" in err, err
    assert not (tmp_path / "o").exists(), "nothing written from a refused report"
    # Read anyway: render/merge go on from the records; verify still says the stored verdict
    # (failed) is not what these records give (exit 1).
    assert _cli(*args, "--ignore-digest") == (1 if action == "verify" else 0)


def test_report_without_digest_is_refused_unless_ignored(report, tmp_path, capsys):
    _edit(report, lambda d: d.pop("records_digest"))
    assert _cli("render", report, "-o", tmp_path / "o") == report_cli.DIGEST_EXIT
    assert "no records_digest" in capsys.readouterr().err
    assert _cli("render", report, "-o", tmp_path / "o", "--ignore-digest") == 0
    rewritten = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rewritten["records_digest"] == records_digest(rewritten["records"])


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["records"].__setitem__(0, "a string"), "records[0]: expected an object"),
    (lambda d: d["records"][0].__setitem__("phases", ["call"]), "records[0].phases"),
    (lambda d: d["records"][1].__setitem__("nodeid", 7), "records[1].nodeid"),
    (lambda d: d["records"][0]["phases"].__setitem__("call", "great"), "records[0].phases"),
    (lambda d: d["records"][0].__setitem__("duration", "long"), "records[0].duration"),
    (lambda d: d.__setitem__("records", {"a": 1}), "no 'records' list"),
])
def test_malformed_records_are_format_errors(report, tmp_path, capsys, change, needle):
    _edit(report, change)
    for ignore in ((), ("--ignore-digest",)):
        assert _cli("render", report, "-o", tmp_path / "o", *ignore) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def test_report_that_is_not_utf8_is_a_format_error(report, tmp_path, capsys):
    report.write_bytes(b'{"schema": "\xff"}')
    assert _cli("verify", report) == 2
    assert "not UTF-8" in capsys.readouterr().err
