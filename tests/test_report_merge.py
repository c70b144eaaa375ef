"""report render (re-verify one report) and report merge (engine x device matrix)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from lora_conformance.report import cli as report_cli
from lora_conformance.report.document import SCHEMA, ReportFormatError, build_report, load_report, write_report
from lora_conformance.report.merge import MergeConflict, merge

OK = {"setup": "passed", "call": "passed", "teardown": "passed"}
FAIL = {"setup": "passed", "call": "failed", "teardown": "passed"}
NC = {"setup": "skipped", "teardown": "passed"}


def env(engine, device, dtype):
    return {"engine": {"name": engine, "version": "1"}, "device": {"name": device, "type": device.split(":")[0]},
            "dtype": dtype, "packages": {"torch": "2.13"}, "date": "1970-01-01"}


def r(nodeid, phases, **kw):
    return {"nodeid": nodeid, "phases": phases, "duration": 1.0, **kw}


def write(tmp_path, name, environment, records):
    out = tmp_path / name
    write_report(build_report(environment, records), out)
    return out / "report.json"


@pytest.fixture
def reports(tmp_path):
    a = write(tmp_path, "builtin-cpu-0", env("builtin", "cpu", "float32"), [
        r("suites/test_mixed_batch.py::test_routing[1]", OK),
        r("suites/test_pinning.py::test_pinned", NC, skip_reason="not certified: engine does not declare pinning",
          outcome={"status": "not certified", "cause": "capability", "detail": "engine does not declare pinning"})])
    # A second shard of the same configuration: merges into the same column.
    b = write(tmp_path, "builtin-cpu-1", env("builtin", "cpu", "float32"), [
        r("suites/test_dora.py::test_dora", OK)])
    c = write(tmp_path, "sglang-xpu", env("sglang", "xpu:0", "bfloat16"), [
        r("suites/test_mixed_batch.py::test_routing[1]", FAIL, message="slot 0 wrong"),
        r("suites/test_pinning.py::test_pinned", OK)])
    return a, b, c


def test_merge_builds_one_matrix(reports):
    m = merge(load_report(p) for p in reports)
    assert [c["key"] for c in m["columns"]] == ["builtin@cpu/float32", "sglang@xpu/bfloat16"]
    assert [c["runs"] for c in m["columns"]] == [2, 1]
    assert [c["score"] for c in m["columns"]] == ["2/3", "1/2"]
    assert m["features"] == ["dora/dora", "mixed_batch/routing", "pinning/pinned"]
    cells = {f: {k: v["status"] for k, v in row.items()} for f, row in m["cells"].items()}
    assert cells == {
        "dora/dora": {"builtin@cpu/float32": "passed"},
        "mixed_batch/routing": {"builtin@cpu/float32": "passed", "sglang@xpu/bfloat16": "failed"},
        "pinning/pinned": {"builtin@cpu/float32": "not certified", "sglang@xpu/bfloat16": "passed"},
    }


def test_merge_refuses_contradicting_shards(tmp_path, reports):
    other = write(tmp_path, "again", env("builtin", "cpu", "float32"),
                  [r("suites/test_dora.py::test_dora", FAIL, message="x")])
    with pytest.raises(MergeConflict, match="builtin@cpu/float32: suites/test_dora.py::test_dora appears in two"):
        merge(load_report(p) for p in [reports[1], other])


def test_merge_command(reports, tmp_path):
    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "lora_conformance.report", "merge", *map(str, reports), "-o", str(out)],
                          capture_output=True, text=True, check=True)
    assert ("into 2 column(s): builtin@cpu/float32 2/3 (certified (selection not recorded)), "
            "sglang@xpu/bfloat16 1/2 (not certified)") in done.stdout
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == "lora-conformance/matrix/1"
    md = (out / "report.md").read_text()
    assert "| Feature | `builtin@cpu/float32` | `sglang@xpu/bfloat16` |" in md
    assert "| `dora/dora` | ✅ passed | — |" in md
    assert "| **passed / counted** | **2/3** | **1/2** |" in md
    html = (out / "report.html").read_text()
    assert 'title="slot 0 wrong"' in html and "<script" not in html


def test_render_reverifies_from_records(reports, tmp_path, capsys):
    data = load_report(reports[2])
    data["verdict"]["summary"]["certified"] = True  # a tampered (or stale) verdict
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    out = tmp_path / "rendered"
    assert report_cli.run(parser.parse_args(["render", str(tampered), "-o", str(out)])) == report_cli.DIGEST_EXIT
    assert report_cli.run(parser.parse_args(["render", str(tampered), "-o", str(out), "--ignore-digest"])) == 0
    captured = capsys.readouterr()
    assert "stored verdict differs" in captured.err
    assert "not certified: 1/2 features pass" in captured.out
    rendered = json.loads((out / "report.json").read_text())
    assert rendered["verdict"]["summary"]["certified"] is False
    assert rendered["records"] == data["records"]
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", "badge.svg"}


def test_load_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "something/else"}')
    with pytest.raises(ReportFormatError, match=f"expected schema '{SCHEMA}' .*, got 'something/else'"):
        load_report(bad)
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    assert report_cli.run(parser.parse_args(["render", str(bad), "-o", str(tmp_path / "o")])) == 2


def _selection(declared, deselected=(), keyword=None, digest="d1"):
    return {"args": [], "paths": ["suites"], "keyword": keyword, "deselected": {n: f for n, f in deselected},
            "declared_features": declared, "suite": {"files": {}, "sha256": digest, "version": "0.1.0"}}


DECLARED = ["dora/dora", "mixed_batch/routing"]
ROUTING, DORA = "suites/test_mixed_batch.py::test_routing[1]", "suites/test_dora.py::test_dora"


def _shard(tmp_path, name, records, selection):
    out = tmp_path / name
    write_report(build_report(env("builtin", "cpu", "float32"), records, selection), out)
    return load_report(out)


def test_shards_that_together_ran_everything_make_a_certified_column(tmp_path):
    one = _shard(tmp_path, "one", [r(ROUTING, OK)], _selection(DECLARED, [(DORA, "dora/dora")]))
    two = _shard(tmp_path, "two", [r(DORA, OK)], _selection(DECLARED, [(ROUTING, "mixed_batch/routing")]))
    assert one["verdict"]["summary"]["certified"] is False, "each shard alone is partial"
    (column,) = merge([one, two])["columns"]
    assert column["summary"]["certified"] is True and column["status"] == "certified"
    assert column["summary"]["coverage"]["complete"] is True


def test_a_partial_column_is_never_certified(tmp_path):
    one = _shard(tmp_path, "one", [r(ROUTING, OK)], _selection(DECLARED, [(DORA, "dora/dora")], keyword="routing"))
    matrix = merge([one])
    (column,) = matrix["columns"]
    assert column["summary"]["certified"] is False and column["status"] == "partial: 1 of 2 features"
    from lora_conformance.report.merge import render_matrix_markdown

    assert "| **status** | **partial: 1 of 2 features** |" in render_matrix_markdown(matrix)


def test_merge_refuses_shards_of_different_suite_files(tmp_path):
    one = _shard(tmp_path, "one", [r(ROUTING, OK)], _selection(DECLARED, digest="d1"))
    two = _shard(tmp_path, "two", [r(DORA, OK)], _selection(DECLARED, digest="d2"))
    with pytest.raises(MergeConflict, match="different suite files"):
        merge([one, two])


STOPPED = {"setup": "passed"}  # what a run stopped by its time limit records for the case it was running
CRASHED = {"setup": "passed", "call": "failed"}  # pytest-xdist's report for a worker that died in the case


@pytest.mark.parametrize("order", ["stopped_first", "finished_first"])
def test_a_run_resumed_where_a_time_limit_stopped_it_makes_one_certified_column(tmp_path, order):
    # The first run was stopped while DORA ran; the second deselected ROUTING (finished) and ran DORA.
    stopped = _shard(tmp_path, "stopped", [r(ROUTING, OK), r(DORA, STOPPED)], {**_selection(DECLARED), "interrupted": True})
    resumed = _shard(tmp_path, "resumed", [r(DORA, OK)], _selection(DECLARED, [(ROUTING, "mixed_batch/routing")]))
    assert stopped["verdict"]["summary"]["certified"] is False
    runs = [stopped, resumed] if order == "stopped_first" else [resumed, stopped]
    matrix = merge(runs)
    (column,) = matrix["columns"]
    assert column["status"] == "certified" and column["resumed"] == [DORA]
    from lora_conformance.report.merge import render_matrix_markdown

    assert f"1 case(s) one run left unfinished, finished by another: `{DORA}`" in render_matrix_markdown(matrix)


def test_a_case_no_run_finished_stays_incomplete(tmp_path):
    one = _shard(tmp_path, "one", [r(ROUTING, OK), r(DORA, STOPPED)], {**_selection(DECLARED), "interrupted": True})
    two = _shard(tmp_path, "two", [r(DORA, STOPPED, duration=2.0)], {**_selection(DECLARED), "interrupted": True})
    (column,) = merge([one, two])["columns"]
    assert column["status"] != "certified" and column["resumed"] == []
    assert column["summary"]["cases_by_status"]["error"] == 1


@pytest.mark.parametrize("first", [CRASHED, {"setup": "failed"}])
def test_a_crash_or_setup_error_is_a_result_a_later_pass_does_not_replace(tmp_path, first):
    one = _shard(tmp_path, "one", [r(ROUTING, OK), r(DORA, first, message="worker 'gw0' crashed")], _selection(DECLARED))
    two = _shard(tmp_path, "two", [r(DORA, OK)], _selection(DECLARED, [(ROUTING, "mixed_batch/routing")]))
    with pytest.raises(MergeConflict, match="appears in two reports with different outcomes"):
        merge([one, two])


def test_runs_of_another_profile_base_or_mode_are_other_columns_never_shards(tmp_path):
    plain = env("builtin", "cuda:0", "bfloat16")
    full = {**plain, "profile": {"name": "full", "models": {"decoder": "synthetic:qwen2.5-1.5b"}},
            "base_model": "synthetic:qwen2.5-1.5b"}
    small = {**full, "base_model": "synthetic:llama"}
    quant = {**plain, "base_quant": {"scheme": "q8_0"}, "engine": {"name": "builtin", "args": {"exec_mode": "compile"}}}
    paths = [write(tmp_path, str(i), e, [r(ROUTING, OK)]) for i, e in enumerate([plain, full, small, quant])]
    keys = [c["key"] for c in merge(load_report(p) for p in paths)["columns"]]
    assert keys == ["builtin@cuda/bfloat16", "builtin@cuda/bfloat16 [base_model synthetic:llama, profile full]",
                    "builtin@cuda/bfloat16 [exec_mode=compile, base q8_0]", "builtin@cuda/bfloat16 [profile full]"]


def test_a_case_that_passed_in_two_runs_keeps_the_first_record(tmp_path):
    one = _shard(tmp_path, "one", [r(ROUTING, OK), r(DORA, OK, duration=3.0)], _selection(DECLARED))
    two = _shard(tmp_path, "two", [r(DORA, OK, duration=5.0)], _selection(DECLARED, [(ROUTING, "mixed_batch/routing")]))
    (column,) = merge([one, two])["columns"]
    assert column["status"] == "certified" and column["resumed"] == []


def test_a_resumed_run_reruns_exactly_the_cases_merge_counts_unfinished():
    """bench/finished_cases.py (what a resumed certification deselects) and merge agree on what a
    result is: a stopped case runs again; a pass, a failure, a crash, a setup error or skip do not."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "finished_cases.py"
    spec = importlib.util.spec_from_file_location("finished_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    phases = {"ok": OK, "fail": FAIL, "crashed": CRASHED, "setup_error": {"setup": "failed"}, "not_certified": NC,
              "stopped": STOPPED, "never_started": {}}
    report = {"records": [r(name, p) for name, p in phases.items()]}
    assert module.finished(report) == ["ok", "fail", "crashed", "setup_error", "not_certified"]


def test_a_case_one_run_never_reached_and_another_ran_is_reached(tmp_path):
    """A run stopped between cases records those it never reached (selection.not_reached): alone it is
    partial; resumed by a run that ran them, the column is whole, and its selection keeps none of
    them; a case no run reached keeps the column partial."""
    ROUTING_2 = "suites/test_mixed_batch.py::test_routing[2]"
    stopped = _shard(tmp_path, "stopped", [r(ROUTING, OK), r(DORA, OK)],
                     {**_selection(DECLARED), "interrupted": True, "not_reached": {ROUTING_2: "mixed_batch/routing"}})
    assert stopped["verdict"]["summary"]["coverage"]["not_run"] == ["mixed_batch/routing"]
    resumed = _shard(tmp_path, "resumed", [r(ROUTING_2, OK)],
                     _selection(DECLARED, [(ROUTING, "mixed_batch/routing"), (DORA, "dora/dora")]))
    matrix = merge([stopped, resumed])
    (column,) = matrix["columns"]
    assert column["status"] == "certified" and column["summary"]["coverage"]["not_reached_cases"] == 0
    (alone,) = merge([stopped])["columns"]
    assert alone["status"] == "partial: 1 of 2 features"
