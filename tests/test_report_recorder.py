"""ReportRecorder end to end: a tiny suite through pytest, then report.json/md/html and badge.svg."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

# Registers the recorder directly (the lead's plugin is disabled with -p no:lora_conformance),
# with the environment facts a plugin would leave in the stash, and the one evidence writer the
# plugin's makereport hook calls.
CONFTEST = """
from types import SimpleNamespace

import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    from lora_conformance.evidence import attach_call_facts
    attach_call_facts(item, call.excinfo)
    yield

def pytest_configure(config):
    from lora_conformance.report.recorder import ENV_KEY, ReportRecorder
    settings = SimpleNamespace(device="xpu:0", engine="fake", engine_args={"tp": "1"}, dtype="bfloat16",
                               reference_device="cpu", reference_dtype="float32", base_model="synthetic:llama")
    config.stash[ENV_KEY] = {"engine": {"version": "9.9"}, "device": {"device_name": "Fake GPU Max", "driver": "1.2.3"}}
    config.pluginmanager.register(ReportRecorder(settings, "out"), "lora-report")
"""

SUITE = '''
import pytest
from lora_conformance.judge.errors import ConformanceAssertionError

@pytest.mark.parametrize("rank", [4, 8])
def test_nearest_reference_routing(rank):
    pass

@pytest.mark.parametrize("step", [0, 1])
def test_greedy_tokens(step):
    if step == 1:
        raise ConformanceAssertionError("greedy tokens differ at step 1", {
            "check": "greedy_tokens", "summary": "step 1: reference 'cat' vs engine 'dog'", "tolerance": 0.05,
            "rows": [{"step": 0, "reference_text": "the", "reference_margin": 2.5, "engine_text": "the", "same": True},
                     {"step": 1, "reference_text": "cat", "reference_margin": 0.01, "engine_text": "dog", "same": False}]})

def test_pinned_adapter_survives():
    from lora_conformance.outcomes import missing_capabilities
    missing_capabilities(["pinning"])

@pytest.mark.xfail(reason="engine bug #41")
def test_dora_matches():
    assert False

def test_graph_replay():
    pytest.skip("not applicable on cpu")

@pytest.fixture
def broken():
    raise RuntimeError("engine failed to start")

def test_needs_engine(broken):
    pass
'''

EXPECTED = {
    "mixed_batch/nearest_reference_routing": "passed",
    "mixed_batch/greedy_tokens": "failed",
    "mixed_batch/pinned_adapter_survives": "not certified",
    "mixed_batch/dora_matches": "xfail",
    "mixed_batch/graph_replay": "skipped",
    "mixed_batch/needs_engine": "error",
}


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST)
    d = pytester.mkdir("suites")
    (d / "test_mixed_batch.py").write_text(SUITE)
    return d


def run(pytester, *args):
    return pytester.runpytest("-p", "no:lora_conformance", "-p", "no:hypothesispytest", "-p", "no:cacheprovider",
                              "suites", *args)


def check_report(out):
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == "lora-conformance/report/2"
    features = data["verdict"]["features"]
    assert {fid: f["status"] for fid, f in features.items()} == EXPECTED
    assert features["mixed_batch/dora_matches"]["reason"] == "engine bug #41"
    assert features["mixed_batch/greedy_tokens"]["counts"]["passed"] == 1
    cases = {c["nodeid"].split("::")[1]: c for c in data["verdict"]["cases"]}
    failed = cases["test_greedy_tokens[1]"]
    assert failed["status"] == "failed"
    assert failed["reason"] == "ConformanceAssertionError: greedy tokens differ at step 1"
    assert failed["evidence"]["rows"][1]["engine_text"] == "dog"
    assert "engine failed to start" in cases["test_needs_engine"]["reason"]
    env = data["environment"]
    assert env["engine"] == {"name": "fake", "version": "9.9", "args": {"tp": "1"}}
    assert env["device"]["name"] == "xpu:0" and env["device"]["type"] == "xpu"
    assert env["device"]["device_name"] == "Fake GPU Max" and env["device"]["driver"] == "1.2.3"
    assert env["dtype"] == "bfloat16" and env["reference"] == {"device": "cpu", "dtype": "float32"}
    assert set(env["packages"]) >= {"torch", "transformers", "peft"} and env["python"] and env["date"]
    assert "git_commit" in env and env["suite_version"]
    return data


def test_recorder_writes_the_report(pytester, suite):
    result = run(pytester)
    result.assert_outcomes(passed=3, failed=1, skipped=2, xfailed=1, errors=1)
    out = pytester.path / "out"
    check_report(out)

    md = (out / "report.md").read_text()
    assert "**LoRA conformance · xpu · 1/5**: not certified." in md
    assert "| `mixed_batch/pinned_adapter_survives` |  | ➖ not certified | 0 | 0 | 0 | 0 | 1 | 0 |" in md
    assert md.index("## Root causes: 3 root causes") < md.index("## Features")
    assert "step 1: reference 'cat' vs engine 'dog'" in md  # the evidence summary of the failure
    assert "| engine | fake 9.9 |" in md

    html = (out / "report.html").read_text()
    assert html.count('<span class="status st-failed">failed</span>') >= 2
    assert '<span class="diff">cat</span>' in html and '<span class="diff">dog</span>' in html
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")

    svg = (out / "badge.svg").read_text()
    assert "LoRA conformance · xpu" in svg and ">1/5<" in svg

    # The terminal table: suite | passed | failed | error | xfail | not certified | skipped
    result.stdout.fnmatch_lines([
        "*LoRA conformance*",
        "3 root causes (2 with unexpected failures, 1 recorded as xfail only)",
        "  1. greedy_tokens: step 1: reference 'cat' vs engine 'dog' [1 failed]: mixed_batch/greedy_tokens",
        "  2. RuntimeError: engine failed to start [1 error]: mixed_batch/needs_engine",
        "  3. AssertionError: assert False [1 xfail]: mixed_batch/dora_matches",
        "suite       | passed | failed | error | xfail | not certified | skipped",
        "mixed_batch |      3 |      1 |     1 |     1 |             1 |       1",
        "LoRA conformance · xpu · 1/5 (not certified)",
        f"report: {out / 'report.html'}",
    ])


def test_recorder_under_xdist(pytester, suite):
    pytest.importorskip("xdist")
    result = run(pytester, "-n", "2", "-p", "no:benchmark")
    result.assert_outcomes(passed=3, failed=1, skipped=2, xfailed=1, errors=1)
    data = check_report(pytester.path / "out")
    assert data["environment"]["engine"]["version"] == "9.9"
    # each case says which worker ran it and when its setup began (seconds from the run's start)
    ran = [r for r in data["records"] if r["phases"].get("setup")]
    assert {r["worker"] for r in ran} <= {"gw0", "gw1"} and all(0 <= r["started"] < 120 for r in ran)
    md = (pytester.path / "out" / "report.md").read_text()
    assert "| workers | gw0: " in md and "idle at the end:" in md


CRASHING = """
import os, signal
import pytest

@pytest.fixture
def engine():
    yield
    if os.environ.get("CRASH_AT") == "teardown":
        os.kill(os.getpid(), signal.SIGSEGV)

def test_engine_segfaults(engine):
    if os.environ.get("CRASH_AT") == "call":
        os.kill(os.getpid(), signal.SIGSEGV)

def test_other():
    pass
"""


@pytest.mark.parametrize("at", ["call", "teardown"])
def test_a_crashed_worker_is_a_failed_case_in_a_written_report(pytester, monkeypatch, at):
    """An engine that kills its worker (a segfault in native code) is a finding: pytest-xdist reports
    the test with the phase '???', which the report records as the phase after the last one the test
    reported, failed, with xdist's crash message; the report is written, never a traceback instead."""
    pytest.importorskip("xdist")
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("suites")
    (pytester.path / "suites" / "test_crash.py").write_text(CRASHING)
    monkeypatch.setenv("CRASH_AT", at)
    result = run(pytester, "-n", "2", "-p", "no:benchmark", "-p", "no:faulthandler")
    assert "RecordFormatError" not in result.stdout.str() + result.stderr.str()
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    crashed = next(r for r in data["records"] if r["nodeid"].endswith("test_engine_segfaults"))
    assert crashed["phases"][at] == "failed" and "???" not in crashed["phases"], crashed["phases"]
    assert crashed["message"].startswith(f"the test's worker process died during {at} (pytest-xdist worker 'gw")
    # every crash is one root cause (the message names no test), whatever the worker
    from lora_conformance.judge.root_causes import normalise

    assert normalise(crashed["message"]) == normalise(crashed["message"].replace("gw0", "gw7").replace("gw1", "gw7"))
    cases = {c["nodeid"].split("::")[1]: c["status"] for c in data["verdict"]["cases"]}
    assert cases["test_engine_segfaults"] == ("failed" if at == "call" else "error")
    assert data["verdict"]["summary"]["certified"] is False


def test_workers_summary_shows_an_unbalanced_run():
    from lora_conformance.report.markdown import workers_summary

    recs = [{"nodeid": "a", "phases": {}, "worker": "gw0", "started": 0.5, "duration": 300.0},
            {"nodeid": "b", "phases": {}, "worker": "gw1", "started": 0.4, "duration": 50.0},
            {"nodeid": "c", "phases": {}, "worker": "gw1", "started": 50.5, "duration": 50.0},
            {"nodeid": "d", "phases": {}, "worker": None, "started": None, "duration": 1.0}]
    assert workers_summary({"records": recs}) == (
        "gw0: 1 tests, busy 300 s, done at 300 s; gw1: 2 tests, busy 100 s, done at 100 s "
        "(idle at the end: 200 s summed over workers)")
    assert workers_summary({"records": recs[:1]}) == ""  # one process: nothing to balance


def test_collection_error_is_reported(pytester, suite):
    (suite / "test_broken.py").write_text("import not_a_module_anywhere\n")
    run(pytester, "--continue-on-collection-errors")
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    feat = data["verdict"]["features"]["broken/(collection)"]
    assert feat["status"] == "error" and "not_a_module_anywhere" in feat["reason"]
    assert data["verdict"]["summary"]["certified"] is False


XFAIL_SUITE = '''
import pytest
from lora_conformance.judge.errors import ConformanceAssertionError

def _served_as_a(label):
    raise ConformanceAssertionError(f"{label}: closest to: served as A (adapter base)",
                                    {"check": "effects", "hypothesis": {"nearest": "served as A", "adapter": "base"}})

@pytest.mark.xfail(reason="base rows get an adapter's delta (recorded bug)", strict=False)
def test_composition():
    _served_as_a("A-base-B")

@pytest.mark.xfail(reason="base rows get an adapter's delta (recorded bug)", strict=False)
def test_saturation():
    _served_as_a("saturated")

def test_routing():
    _served_as_a("routing")
'''


def test_xfails_group_with_failures_by_their_nearest_hypothesis(pytester):
    """An xfail's evidence is kept, so a recorded bug and a new failure of the same bug are one cause
    ("hypothesis: served as A"), whatever each test's message says first."""
    pytester.makeconftest(CONFTEST)
    (pytester.mkdir("suites") / "test_mixed_batch.py").write_text(XFAIL_SUITE)
    result = run(pytester)
    result.assert_outcomes(failed=1, xfailed=2)
    cases = {c["nodeid"].split("::")[1]: c for c in json.loads((pytester.path / "out" / "report.json").read_text())
             ["verdict"]["cases"]}
    assert cases["test_composition"]["evidence"]["hypothesis"]["nearest"] == "served as A"
    result.stdout.fnmatch_lines([
        "1 root cause* (1 with unexpected failures*",
        "  1. closest to: served as A: rows got a wrong adapter (another one, or none) [2 xfail, 1 failed]: "
        "mixed_batch/composition, mixed_batch/routing, mixed_batch/saturation",
    ])


def test_a_tree_that_differs_from_its_commit_says_so(tmp_path):
    import subprocess

    from lora_conformance.report.environment import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "suite.py").write_text("x = 1\n")
    git("add", "suite.py")
    git("commit", "-qm", "one")
    head = git_commit(tmp_path)
    assert head and len(head) == 40
    (tmp_path / "untracked.txt").write_text("not part of the tree\n")
    assert git_commit(tmp_path) == head, "an untracked file does not change what ran"
    (tmp_path / "suite.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+modified"


def test_a_run_xdist_stopped_for_crashes_says_why_it_is_partial(pytester):
    """pytest-xdist replaces a crashed worker --max-worker-restart times, then ends the run as if it
    had finished: the report is partial and says it stopped for crashed workers, not for a selection."""
    pytest.importorskip("xdist")
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("suites")
    (pytester.path / "suites" / "test_crash.py").write_text(
        "import os, signal\n"
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_engine_segfaults(i):\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    run(pytester, "-n", "1", "--max-worker-restart", "1", "-p", "no:benchmark", "-p", "no:faulthandler")
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    assert data["selection"]["stopped"] == ("the run's stop after 2 crashed workers (pytest-xdist replaces at "
                                            "most 1: --max-worker-restart)")
    assert len(data["records"]) == 2 and data["verdict"]["summary"]["certified"] is False
    md = (pytester.path / "out" / "report.md").read_text()
    assert "selected by the run's stop after 2 crashed workers (pytest-xdist replaces at most 1" in md
