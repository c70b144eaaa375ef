"""Honest partial runs: the report records what a run selected (-k, -m, --lf, file and node-id
arguments, deselected cases, the suite files' digest, the version), and a run that did not run every
feature the suite declares is "partial: N of M features", never certified: its badge is not green,
and ``report verify`` says so. Shards that together ran everything merge into a certified column."""

from __future__ import annotations

import argparse
import json

import pytest

from lora_conformance.report import cli as report_cli

pytest_plugins = ["pytester"]

ROUTING = '''
import pytest

@pytest.mark.feature("routing/base_rows_stay_base", "base rows get no adapter delta")
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_base_rows(n):
    pass

@pytest.mark.feature("routing/nearest", "each row nearest its own reference")
def test_nearest():
    pass
'''
LIFECYCLE = '''
import os
import pytest

@pytest.mark.feature("lifecycle/reload", "reload gives the first load's outputs")
def test_reload():
    assert not os.environ.get("BREAK_RELOAD"), "reload served stale weights"
'''


@pytest.fixture
def suite(pytester):
    d = pytester.mkdir("suites")
    (d / "test_routing.py").write_text(ROUTING)
    (d / "test_lifecycle.py").write_text(LIFECYCLE)
    return d


def run(pytester, *args):
    out = pytester.path / "report"
    result = pytester.runpytest("--engine=builtin", "--device=cpu", f"--lora-report={out}", *args)
    return result, json.loads((out / "report.json").read_text()), out


def _verify(out, capsys):
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    code = report_cli.run(parser.parse_args(["verify", str(out)]))
    return code, capsys.readouterr().out


def test_full_run_is_certified_and_records_its_selection(pytester, suite, capsys):
    result, data, out = run(pytester, "suites", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    summary = data["verdict"]["summary"]
    assert summary["certified"] is True
    assert summary["coverage"] == {"complete": True, "features_run": 3, "features_declared": 3, "not_run": [],
                                   "deselected_cases": 0, "not_reached_cases": 0}
    sel = data["selection"]
    assert sel["declared_features"] == ["lifecycle/reload", "routing/base_rows_stay_base", "routing/nearest"]
    assert sel["keyword"] is None and sel["markexpr"] is None and sel["last_failed"] is False
    assert sel["paths"] == ["suites"] and sel["deselected"] == {}
    assert set(sel["suite"]["files"]) == {"suites/test_routing.py", "suites/test_lifecycle.py"}
    assert len(sel["suite"]["sha256"]) == 64 and sel["suite"]["version"]
    assert "#2e7d32" in (out / "badge.svg").read_text(), "green"
    code, said = _verify(out, capsys)
    assert code == 0 and "certified: 3/3 features pass" in said and "partial" not in said


def test_k_selection_is_partial_everywhere(pytester, suite, capsys):
    result, data, out = run(pytester, "suites", "-p", "no:cacheprovider", "-k", "routing")
    result.assert_outcomes(passed=3)
    assert data["selection"]["keyword"] == "routing"
    assert data["selection"]["deselected"] == {"suites/test_lifecycle.py::test_reload": "lifecycle/reload"}
    summary = data["verdict"]["summary"]
    assert summary["certified"] is False
    assert summary["coverage"]["features_run"] == 2 and summary["coverage"]["features_declared"] == 3
    assert summary["coverage"]["not_run"] == ["lifecycle/reload"]
    badge = (out / "badge.svg").read_text()
    assert "#2e7d32" not in badge and "2/2 partial" in badge
    md = (out / "report.md").read_text()
    assert "partial: 2 of 3 features" in md and "selected by -k &#x27;routing&#x27;" not in md
    assert "**Partial run: 2 of 3 features ran**, selected by -k 'routing', 1 case(s) deselected" in md
    assert "Not run: `lifecycle/reload`" in md
    result.stdout.fnmatch_lines(["partial run: 2 of 3 features ran (selected by -k 'routing', 1 case(s) "
                                 "deselected); a certification runs them all",
                                 "LoRA conformance · cpu · 2/2 partial (partial: 2 of 3 features)"])
    code, said = _verify(out, capsys)
    assert code == 0
    assert "partial: 2 of 3 features: 2/2 features pass (selected by -k 'routing', 1 case(s) deselected); " \
           "a partial run certifies nothing" in said
    assert "\ncertified" not in said


def test_m_deselecting_some_cases_of_a_feature_is_partial(pytester, suite):
    _, data, _ = run(pytester, "suites", "-p", "no:cacheprovider", "-m", "not slow")
    cov = data["verdict"]["summary"]["coverage"]
    assert data["selection"]["markexpr"] == "not slow"
    assert cov["not_run"] == ["routing/base_rows_stay_base"] and cov["deselected_cases"] == 1
    assert data["verdict"]["summary"]["certified"] is False


def test_a_file_argument_is_partial(pytester, suite):
    _, data, _ = run(pytester, "suites/test_routing.py", "-p", "no:cacheprovider")
    assert data["selection"]["paths"] == ["suites/test_routing.py"]
    assert data["verdict"]["summary"]["coverage"]["not_run"] == ["lifecycle/reload"]
    assert data["verdict"]["summary"]["certified"] is False


def test_last_failed_after_a_failing_run_is_partial(pytester, suite, monkeypatch):
    monkeypatch.setenv("BREAK_RELOAD", "1")
    result, data, _ = run(pytester, "suites")
    result.assert_outcomes(passed=3, failed=1)
    monkeypatch.delenv("BREAK_RELOAD")
    result, data, out = run(pytester, "suites", "--lf")
    result.assert_outcomes(passed=1)
    assert data["selection"]["last_failed"] is True
    summary = data["verdict"]["summary"]
    assert summary["certified"] is False and summary["coverage"]["features_run"] == 1
    assert "1/1 partial" in (out / "badge.svg").read_text()


def test_partial_under_xdist(pytester, suite):
    pytest.importorskip("xdist")
    result, data, _ = run(pytester, "suites", "-p", "no:cacheprovider", "-n", "2", "-k", "routing")
    result.assert_outcomes(passed=3)
    assert data["selection"]["deselected"] == {"suites/test_lifecycle.py::test_reload": "lifecycle/reload"}
    assert data["verdict"]["summary"]["certified"] is False
    assert data["verdict"]["summary"]["coverage"]["not_run"] == ["lifecycle/reload"]


def test_an_interrupted_run_is_partial_and_says_so(pytester, suite):
    # pytest.exit with status 2 is how pytest ends an interrupted session (a KeyboardInterrupt would
    # also stop this inline run's caller).
    (suite / "test_routing.py").write_text(ROUTING + "\n\ndef test_zz_interrupt():\n"
                                           "    pytest.exit('interrupted', returncode=2)\n")
    result, data, _ = run(pytester, "suites", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert data["selection"]["interrupted"] is True
    assert data["verdict"]["summary"]["certified"] is False
    assert "an interrupt" in (pytester.path / "report" / "report.md").read_text()


STOPS_BETWEEN_CASES = '''
import pytest

@pytest.fixture
def stop_after(request):
    yield
    if request.node.callspec.params["n"] == 1:
        pytest.exit("stopped between cases", returncode=2)

@pytest.mark.feature("routing/nearest", "each row nearest its own reference")
def test_nearest():
    pass

@pytest.mark.feature("routing/base_rows_stay_base", "base rows get no adapter delta")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_base_rows(n, stop_after):
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["one-process", "xdist"])
def test_cases_never_reached_make_the_run_partial(pytester, suite, workers):
    """A run that stops between two cases of a feature (an interrupt, pytest-xdist's stop after
    crashed workers) leaves selected cases without a record: every feature ran at least one case,
    yet the run is partial, and the report counts and names what it never reached. Without the
    collected cases a report could call such a run complete, and certify it."""
    if workers:
        pytest.importorskip("xdist")
    (suite / "test_routing.py").write_text(STOPS_BETWEEN_CASES)
    result, data, out = run(pytester, "suites", "-p", "no:cacheprovider", *workers)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    ran = {r["nodeid"] for r in data["records"]}
    assert "suites/test_lifecycle.py::test_reload" in ran
    unreached = data["selection"]["not_reached"]
    assert set(unreached) == {"suites/test_routing.py::test_base_rows[2]", "suites/test_routing.py::test_base_rows[3]"}
    assert {"suites/test_routing.py::test_nearest", "suites/test_routing.py::test_base_rows[1]"} <= ran
    assert unreached["suites/test_routing.py::test_base_rows[2]"] == "routing/base_rows_stay_base"
    summary = data["verdict"]["summary"]
    assert summary["certified"] is False and summary["coverage"]["complete"] is False
    assert summary["coverage"]["not_run"] == ["routing/base_rows_stay_base"]
    assert summary["coverage"]["not_reached_cases"] == len(unreached)
    assert f"{len(unreached)} selected case(s) never reached" in (out / "report.md").read_text()
