"""Certified mode (lora_conformance.certification), waivers with a suite version and their
re-confirmation, the verdict that follows (judge.verdict.certification_summary), and the audit
inside every run (judge.audit)."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path

import pytest

from lora_conformance import certification, launch
from lora_conformance.judge import audit
from lora_conformance.judge.checks import Judge
from lora_conformance.judge.verdict import certification_summary, verify
from lora_conformance.settings import suites_dir
from lora_conformance.types import GenerationRequest, GenerationResult


def _certify_args(*argv):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("extra, refused", [
    (["--", "-k", "routing"], "pytest arguments -k routing"),
    (["--", "-m", "not slow"], "pytest arguments -m not slow"),
    (["--", "suites/test_mixed_batch.py"], "suites/test_mixed_batch.py"),
    (["--", "--lf"], "--lf"),
    (["--suite-dir", "elsewhere"], "--suite-dir"),
])
def test_certify_certified_refuses_to_start_when_narrowed(tmp_path, capsys, extra, refused):
    ran = []
    args = _certify_args("--device", "cpu", "--certified", "--report", str(tmp_path), *extra)
    assert launch.run(args, runner=ran.append) == 2
    err = capsys.readouterr().err
    assert not ran and "--certified" in err and refused in err and "nothing was run" in err


def test_certify_certified_may_be_quieter_and_parallel(tmp_path):
    ran = []
    args = _certify_args("--device", "cpu", "--certified", "--report", str(tmp_path), "--", "-q", "-n", "2")
    launch.run(args, runner=lambda cmd: ran.append(cmd) or 1)
    assert ran and "--lora-certified" in ran[0] and ran[0][-3:] == ["-q", "-n", "2"]


def _plugin_run(pytester, *args):
    return pytester.runpytest_subprocess("-p", "lora_conformance.plugin", "-p", "no:cacheprovider", *args)


def test_a_certified_run_refuses_an_expectations_file_without_issue_links(pytester):
    waivers = pytester.path / "my.toml"
    waivers.write_text(textwrap.dedent("""
        [[expect]]
        feature = "mixed_batch/nearest_reference_routing"
        status = "xfail"
        reason = "routing is off on our device"
        recorded_against = "0.1.0"
    """))
    result = _plugin_run(pytester, str(suites_dir()), "--device=cpu", "--lora-certified", f"--expectations={waivers}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"{waivers}" in err and "entry 1" in err and "field 'link' is missing" in err, err


def test_a_certified_pytest_run_refuses_a_narrowed_selection(pytester):
    result = _plugin_run(pytester, str(suites_dir()), "--device=cpu", "--lora-certified", "-k", "routing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "-k: a certified run may not narrow" in result.stderr.str()


STALE = textwrap.dedent("""
    [[expect]]
    feature = "x/still_broken"
    status = "skip"
    reason = "hangs the engine"
    link = "https://example.org/issues/1"
    recorded_against = "0.0.1"

    [[expect]]
    feature = "x/fixed_since"
    status = "xfail"
    reason = "was wrong"
    link = "https://example.org/issues/2"
    recorded_against = "0.0.1"

    [[expect]]
    feature = "x/current"
    status = "xfail"
    reason = "wrong"
    link = "https://example.org/issues/3"
    recorded_against = "{version}"
""")


def test_stale_waivers_are_run_and_must_still_fail(pytester):
    """An entry recorded against another suite version runs in a certified run: a skip becomes a
    strict xfail (it runs), an xfail that now passes fails; a current entry applies as written."""
    (pytester.path / "waivers.toml").write_text(STALE.format(version=certification.suite_version()))
    pytester.makeconftest(textwrap.dedent("""
        from lora_conformance.expectations import ExpectationsPlugin

        def pytest_configure(config):
            config.pluginmanager.register(ExpectationsPlugin("waivers.toml", certified=True), "waivers")
    """))
    pytester.makepyfile(test_x=textwrap.dedent("""
        import pytest

        @pytest.mark.feature("x/still_broken", "still broken")
        def test_still_broken():
            assert False, "still wrong"

        @pytest.mark.feature("x/fixed_since", "fixed since")
        def test_fixed_since():
            pass

        @pytest.mark.feature("x/current", "current")
        def test_current():
            assert False
    """))
    result = pytester.runpytest("-p", "no:cacheprovider", "-rxXf")
    result.assert_outcomes(xfailed=2, failed=1)
    out = result.stdout.str()
    assert "re-confirming (recorded against suite 0.0.1)" in out and "[XPASS(strict)]" in out


def _record(nodeid, phases, wasxfail=None, feature=None):
    from lora_conformance.evidence import Record

    return Record(nodeid=nodeid, phases=phases, wasxfail=wasxfail,
                  feature={"id": feature, "description": "d"} if feature else None)


def test_waivers_say_which_stale_ones_were_reconfirmed_and_the_verdict_follows(tmp_path):
    from lora_conformance.expectations import ExpectationsPlugin

    path = tmp_path / "w.toml"
    path.write_text(STALE.format(version=certification.suite_version()))
    plugin = ExpectationsPlugin(path, certified=True)
    records = [
        _record("t.py::test_still_broken", {"setup": "passed", "call": "skipped"}, "re-confirming", "x/still_broken"),
        _record("t.py::test_fixed_since", {"setup": "passed", "call": "failed"}, None, "x/fixed_since"),
        _record("t.py::test_current", {"setup": "passed", "call": "skipped"}, "expected", "x/current"),
        _record("t.py::test_other", {"setup": "passed", "call": "passed"}, None, "x/other"),
    ]
    waived = certification.waivers(records, plugin.lookup, certification.CERTIFIED)
    by = {w["feature"]: w for w in waived}
    assert by["x/still_broken"]["reconfirmed"] is True and by["x/still_broken"]["issue"].endswith("/1")
    assert by["x/fixed_since"]["reconfirmed"] is False and by["x/current"]["reconfirmed"] is None
    summary = certification_summary({"mode": "certified", "waived": waived, "audit": {"sampled": 2}})
    assert summary["not_reconfirmed"] == ["t.py::test_fixed_since"] and not summary["holds"]
    assert summary["waived_features"] == 3
    # an open run does not re-confirm; its waivers are listed all the same
    open_waived = certification.waivers(records, plugin.lookup, certification.OPEN)
    assert all(w["reconfirmed"] is None for w in open_waived)
    assert certification_summary({"mode": "open", "waived": open_waived})["holds"]
    verdict = verify([r.as_dict() for r in records[3:]], None,
                     {"mode": "open", "waived": [], "audit": {"sampled": 1, "mismatches": [{"nodeid": "a"}]}})
    assert not verdict.certified and verdict.summary["certification"]["audit_mismatches"] == 1


def test_a_certified_entry_needs_a_suite_version(tmp_path):
    from lora_conformance.expectations import ExpectationsPlugin

    path = tmp_path / "w.toml"
    path.write_text('[[expect]]\nfeature = "x/y"\nstatus = "xfail"\nreason = "r"\nlink = "https://e.org/1"\n')
    ExpectationsPlugin(path)  # an open run takes it
    with pytest.raises(pytest.UsageError, match=r"entry 1 \(x/y\): field 'recorded_against' is missing"):
        ExpectationsPlugin(path, certified=True)
    path.write_text(path.read_text() + 'recorded_against = "soon"\n')
    with pytest.raises(pytest.UsageError, match="field 'recorded_against' is 'soon'"):
        ExpectationsPlugin(path)


# ---- the audit ------------------------------------------------------------------------------


class _Runner:
    def decode_token(self, token_id):
        return f"<{token_id}>"


def _output(tokens, shift=0.0):
    return GenerationResult(text=" ".join(map(str, tokens)), token_ids=list(tokens),
                            logprobs=[{t: -0.1 - shift, t + 1: -3.0} for t in tokens])


class _Engine:
    """Answers each prompt by its length; ``drift`` adds to every logprob after the first batch
    (state kept across requests); ``order`` makes a row depend on its batch position."""

    def __init__(self, drift=0.0, order=False):
        self.drift, self.order, self.calls, self.loaded = drift, order, 0, {}

    def load_adapter(self, name, path):
        self.loaded[name] = path

    def generate(self, requests):
        self.calls += 1
        out = []
        for i, r in enumerate(requests):
            shift = self.drift * (self.calls - 1) + (2.0 * i if self.order else 0.0)
            out.append(_output([len(r.prompt), len(r.prompt) + 1], shift))
        return out

    def close(self):
        pass


def _case(engine):
    reqs = [GenerationRequest(prompt=p, adapter=a, max_new_tokens=2) for p, a in (("ab", "A"), ("abcd", None))]
    return audit.AuditCase("t::x", Path("."), "float32", {}, {"A": Path("A")}, reqs, engine.generate(reqs), True)


@pytest.mark.parametrize("engine, caught", [
    (_Engine(), False),
    (_Engine(order=True), True),  # rows depend on their neighbours in the batch
])
def test_the_audit_asks_a_fresh_engine_in_another_batch_order(engine, caught):
    case = _case(engine)
    fresh = type(engine)(engine.drift, engine.order)
    problem = audit.replay(case, lambda c: fresh, Judge("float32", _Runner(), lambda e: None))
    assert (problem is not None) == caught, problem
    assert fresh.loaded == {"A": Path("A")}


def test_the_audit_catches_state_left_by_earlier_requests():
    run_engine = _Engine(drift=1.0)
    run_engine.generate([GenerationRequest(prompt="warm", max_new_tokens=1)])  # the run served before
    case = _case(run_engine)  # the run's answer came from a drifted engine
    problem = audit.replay(case, lambda c: _Engine(drift=1.0), Judge("float32", _Runner(), lambda e: None))
    assert problem is not None and "audit of t::x" in problem


def test_the_audit_samples_passed_cases_by_its_seed_and_reports_a_dead_engine():
    cases = [audit.AuditCase(f"t::{i}", Path("."), "float32", {}, {}, [], [], passed=i % 2 == 0) for i in range(10)]
    first = audit.sample(cases, seed=7, k=3)
    assert first == audit.sample(cases, seed=7, k=3) and all(c.passed for c in first) and len(first) == 3

    def broken(case):
        raise RuntimeError("out of memory")

    result = audit.run(cases, 7, broken, lambda c: None, k=2)
    assert result.sampled == 2 and [m["difference"] for m in result.mismatches] == [
        "the fresh engine failed: RuntimeError: out of memory"] * 2


def test_the_audit_never_replays_a_case_whose_adapter_directory_was_rewritten(tmp_path):
    """A test that writes new weights over a directory it loaded (a retrained adapter saved in place)
    leaves cases whose adapter is no longer on disk: a fresh engine would load the new weights and
    differ from a correct run, so such cases are not sampled."""
    kept, rewritten = tmp_path / "kept", tmp_path / "rewritten"
    for d in (kept, rewritten):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"first weights")
    cases = [audit.AuditCase(f"t::{d.name}", Path("."), "float32", {}, {"X": d}, [], [], passed=True)
             for d in (kept, rewritten)]
    assert [c.nodeid for c in audit.sample(cases, seed=1, k=2)] == ["t::kept", "t::rewritten"]
    (rewritten / "adapter_model.safetensors").write_bytes(b"other weights")  # the same size, written again
    st = (rewritten / "adapter_model.safetensors").stat()
    os.utime(rewritten / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert [c.nodeid for c in audit.sample(cases, seed=1, k=2)] == ["t::kept"]


def test_every_run_reports_its_audit(tmp_path):
    """A (partial) run of the built-in engine: the report has the certification block with the
    audit of sampled passed cases, none of them different."""
    report_dir = tmp_path / "rep"
    args = _certify_args("--device", "cpu", "--report", str(report_dir), "-n", "1", "--", "-q", "-k",
                         "composition_matches_isolated_references and all-same")
    assert launch.run(args) == 0
    data = json.loads((report_dir / "report.json").read_text())
    cert = data["certification"]
    assert cert["mode"] == "open" and cert["suite_version"] == certification.suite_version()
    assert cert["audit"]["sampled"] == 1 and cert["audit"]["mismatches"] == [], cert["audit"]
    assert data["verdict"]["summary"]["certification"]["holds"]


def test_a_certified_mode_badge_counts_waived_features_apart():
    from lora_conformance.report.badge import badge_text

    records = [_record("t.py::test_a", {"setup": "passed", "call": "passed"}, None, "x/a").as_dict(),
               _record("t.py::test_b", {"setup": "passed", "call": "skipped"}, "expected", "x/b").as_dict()]
    waived = [{"nodeid": "t.py::test_b", "feature": "x/b", "status": "xfail", "issue": "https://e.org/1",
               "recorded_against": certification.suite_version(), "stale": False, "reconfirmed": None}]
    verdict = verify(records, None, {"mode": "certified", "waived": waived, "audit": {"sampled": 1}})
    assert badge_text(verdict, "cpu") == ("LoRA conformance · cpu · certified mode", "1 passed, 1 waived / 2")
    open_verdict = verify(records, None, {"mode": "open", "waived": waived, "audit": {}})
    assert badge_text(open_verdict, "cpu")[1] == "1/2"


def test_a_bundled_waiver_of_an_older_suite_is_reconfirmed_in_a_certified_run():
    """The bundled files' entries were recorded against an older suite than the installed one:
    under --lora-certified each is applied as a strict xfail that runs (a skip too)."""
    from lora_conformance.expectations import PACKAGED_DIR, load_expectations

    stale = [(f.name, e) for f in sorted(PACKAGED_DIR.glob("*.toml")) for e in load_expectations(f)
             if certification.is_stale(e)]
    assert stale, "no bundled entry of an older suite version"
    assert all(e.recorded_against != certification.suite_version() for _, e in stale)
    assert any(e.status == "skip" for _, e in stale) and any(e.status == "xfail" for _, e in stale)


def test_the_audit_starts_its_fresh_engines_after_the_shared_ones_and_the_reference_models_are_gone():
    """At the end of a run the shared engines close, and the references drop their loaded models, before
    the audit starts fresh engines: a real-shape base held twice beside the reference, then one engine
    beside the reference's base and copy, ran a 24 GiB cpu host out of memory there (OOM, no report)."""
    from lora_conformance.context import audit_at_end

    events = []

    class FakeWorkspace:
        def __init__(self):
            self.models = 2  # the reference's base and one adapted copy

        def release_reference_models(self):
            events.append(("release", self.models))
            self.models = 0

    class FakeHarness:
        def __init__(self):
            self.open = 1  # one shared engine
            self.workspace = FakeWorkspace()

        def close(self):
            events.append(("close", self.open))
            self.open = 0

    def fake_audit(harness, seed):
        events.append(("audit", harness.open, harness.workspace.models, seed))
        harness.open += 1  # the audit's fresh engine
        return {"sampled": 1}

    audit_at_end("config", FakeHarness(), 7, fake_audit,
                 lambda config, audit: events.append(("kept", config, audit["sampled"])))
    assert events == [("close", 1), ("release", 2), ("audit", 0, 0, 7), ("kept", "config", 1), ("close", 1)], events
