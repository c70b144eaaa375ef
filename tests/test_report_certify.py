"""lora-conformance certify: the pytest command it builds, its exit codes, what it prints."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from lora_conformance.report import certify
from lora_conformance.report.document import build_report, write_report


def parse(*argv):
    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_pytest_command(tmp_path):
    args = parse("--device", "xpu", "--engine", "sglang", "--engine-arg", "tp=2", "--engine-arg", "mem=0.5",
                 "--dtype", "bfloat16", "--base-model", "synthetic:moe", "--report", str(tmp_path / "r"),
                 "--suite-dir", str(tmp_path), "--", "-n", "4", "-k", "mixed_batch")
    assert certify.pytest_command(args) == [
        sys.executable, "-m", "pytest", str(tmp_path), "--device=xpu", "--engine=sglang", "--engine-arg=tp=2",
        "--engine-arg=mem=0.5", "--dtype=bfloat16", "--base-model=synthetic:moe",
        f"--lora-report={(tmp_path / 'r').resolve()}", "-n", "4", "-k", "mixed_batch"]


def test_defaults():
    args = parse("--device", "cpu", "--engine", "builtin")
    cmd = certify.pytest_command(args)
    assert cmd[3].endswith("suites") and cmd[-1].endswith("lora-report") and cmd[-1].startswith("--lora-report=/")


def test_no_tests_collected_is_an_error(tmp_path, capsys):
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path))
    assert certify.run(args, runner=lambda cmd: 5) == 5
    assert "no tests were collected" in capsys.readouterr().err


def test_prints_report_and_badge_and_returns_pytest_code(tmp_path, capsys):
    report_dir = tmp_path / "rep"

    def fake_pytest(cmd):
        assert f"--lora-report={report_dir.resolve()}" in cmd
        assert not (report_dir / "report.json").exists()  # the stale report was removed first
        write_report(build_report({"device": {"type": "xpu"}}, [
            {"nodeid": "s/test_a.py::test_x", "phases": {"setup": "passed", "call": "failed"}, "message": "m"},
            {"nodeid": "s/test_a.py::test_y", "phases": {"setup": "passed", "call": "passed"}}]), report_dir)
        return 1

    write_report(build_report({}, []), report_dir)  # stale
    args = parse("--device", "xpu", "--engine", "fake", "--report", str(report_dir))
    assert certify.run(args, runner=fake_pytest) == 1
    out = capsys.readouterr().out
    assert f"report: {report_dir.resolve() / 'report.html'}" in out
    assert "(LoRA conformance · xpu · 1/2 (not certified))" in out


def test_missing_report_is_an_error(tmp_path, capsys):
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path))
    assert certify.run(args, runner=lambda cmd: 0) == 1
    assert "no report was written (pytest exit code 0)" in capsys.readouterr().err


def test_certify_runs_pytest_for_real(tmp_path, capsys):
    pytest.importorskip("lora_conformance.plugin", reason="lora_conformance.plugin not written yet")
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_tiny.py").write_text("def test_ok():\n    pass\n")
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path / "rep"),
                 "--suite-dir", str(suites), "--", "-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-q")
    assert certify.run(args) == 0
    assert "LoRA conformance · cpu · 1/1 (certified)" in capsys.readouterr().out
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["verdict"]["features"]["tiny/ok"]["status"] == "passed"
