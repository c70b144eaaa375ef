"""Sharding: LPT correctness, determinism, measured durations, and the ``ci matrix`` command."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lora_conformance.ci import cli as ci_cli
from lora_conformance.ci import partition as part


def test_lpt_assigns_longest_first_to_the_least_loaded_shard():
    shards = part.lpt({"a": 7, "b": 5, "c": 4, "d": 3, "e": 3, "f": 2}, 2)
    # 7->0, 5->1, 4->1 (5<7), 3->0 (9 vs 10), 3->1? loads 10/9 -> 1 gets 3 -> 12; 2 -> 0 (10)
    assert [s.files for s in shards] == [("a", "d", "f"), ("b", "c", "e")]
    assert [s.est_time for s in shards] == [12.0, 12.0]


def test_lpt_ties_break_by_path_then_shard_index():
    shards = part.lpt({"z": 1, "y": 1, "x": 1, "w": 1}, 3)
    # sorted by (time, path): w, x, y, z; w->0, x->1, y->2, z->0 (all loads equal: lowest index)
    assert [s.files for s in shards] == [("w", "z"), ("x",), ("y",)]


@settings(max_examples=60, deadline=None)
@given(times=st.dictionaries(st.text("abcdef/_", min_size=1, max_size=8),
                             st.floats(min_value=0, max_value=1000, allow_nan=False), max_size=20),
       n=st.integers(min_value=1, max_value=6), seed=st.integers(0, 1000))
@example(times={"_": 0.00078}, n=4, seed=0)  # est_time 0.001 (rounded) is above the unrounded bound 0.000975
def test_lpt_is_a_deterministic_partition(times, n, seed):
    shards = part.lpt(times, n)
    members = [f for s in shards for f in s.files]
    assert sorted(members) == sorted(times)  # every file exactly once
    shuffled = list(times.items())
    random.Random(seed).shuffle(shuffled)
    assert part.lpt(dict(shuffled), n) == shards  # insertion order does not matter
    if times:
        # LPT's guarantee: no shard's load exceeds the mean load plus the longest single job. It holds
        # for the exact loads; est_time is the load rounded to 0.001, so it may pass the bound by up
        # to 0.0005 and is checked against the load it rounds. slack: float sums in another order.
        total = sum(times.values())
        bound = total / n + max(times.values())
        slack = 1e-9 * max(total, 1.0)
        for shard in shards:
            load = sum(times[f] for f in shard.files)
            assert load <= bound + slack
            assert abs(shard.est_time - load) <= 0.0005 + slack


@pytest.mark.parametrize("value", ["1", "a/b", "4/4", "-1/3", "0/0", "1/2/3", ""])
def test_parse_partition_rejects(value):
    with pytest.raises(ValueError, match="expected i/n with 0 <= i < n"):
        part.parse_partition(value)


def test_parse_partition_accepts():
    assert part.parse_partition(" 2/5 ") == (2, 5)


def test_durations_from_junit_report_json_and_mapping(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(textwrap.dedent("""\
        <testsuites><testsuite name="pytest">
          <testcase classname="suites.test_a" name="test_x[1]" time="1.5"/>
          <testcase classname="suites.test_a" name="test_x[2]" time="2.5"/>
          <testcase classname="suites.test_b.TestGroup" name="test_y" time="3"/>
          <testcase classname="suites.test_c" file="suites/test_c.py" name="test_z" time="0.25"/>
        </testsuite></testsuites>"""))
    assert part.load_durations(junit) == {"suites/test_a.py": 4.0, "suites/test_b.py": 3.0, "suites/test_c.py": 0.25}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema": "lora-conformance/report/1", "records": [
        {"nodeid": "suites/test_a.py::test_x[1]", "duration": 1.0},
        {"nodeid": "suites/test_a.py::test_x[2]", "duration": 2.0},
        {"nodeid": "suites/test_b.py::test_y", "duration": 0.5}]}))
    assert part.load_durations(report) == {"suites/test_a.py": 3.0, "suites/test_b.py": 0.5}
    mapping = tmp_path / "d.json"
    mapping.write_text('{"suites/test_a.py": 9}')
    assert part.load_durations(mapping) == {"suites/test_a.py": 9.0}


def test_measured_matches_by_path_suffix(tmp_path):
    f = tmp_path / "suites" / "test_a.py"
    assert part.measured({"suites/test_a.py": 3.0, "test_a.py": 1.0}, f) == 3.0  # longest match wins
    assert part.measured({"other/test_a.py": 3.0}, f) is None


# ---- ci matrix / ci list ------------------------------------------------------------


@pytest.fixture
def suites(tmp_path):
    d = tmp_path / "suites"
    d.mkdir()
    for name, body in {
        "test_a.py": 'register_cpu_ci(est_time=100, suite="per-commit")\nregister_xpu_ci(est_time=5, suite="per-commit")\n',
        "test_b.py": 'register_cpu_ci(est_time=60, suite="per-commit")\n',
        "test_c.py": 'register_cpu_ci(est_time=50, suite="per-commit")\n',
        "test_d.py": 'register_cpu_ci(est_time=10, suite="per-commit")\n',
        "test_e.py": 'register_cpu_ci(est_time=500, suite="per-commit", disabled="hangs on this runner")\n',
        "test_f.py": 'register_cpu_ci(est_time=30, suite="per-commit", nightly=True)\n',
        "test_g.py": "def test_unregistered(): pass\n",
    }.items():
        (d / name).write_text("from lora_conformance.ci import *\n" + body)
    return d


def files_of(matrix):
    return [[Path(f).name for f in shard["files"]] for shard in matrix["include"]]


def test_matrix_uses_estimates(suites):
    m = ci_cli.matrix(suites, "cpu", "per-commit", 2)
    assert [s["partition"] for s in m["include"]] == ["0/2", "1/2"]
    # 100 -> 0; 60 -> 1; 50 -> 1 (60 < 100); 10 -> 0 (100 < 110). Disabled, nightly and
    # other-hardware registrations are not in the matrix.
    assert files_of(m) == [["test_a.py", "test_d.py"], ["test_b.py", "test_c.py"]]
    assert [s["est_time"] for s in m["include"]] == [110.0, 110.0]


def test_matrix_nightly_and_fewer_files_than_shards(suites):
    m = ci_cli.matrix(suites, "cpu", "per-commit", 10, nightly=True)
    assert len(m["include"]) == 5  # a, b, c, d, f: never an empty shard
    assert all(s["partition"].endswith("/5") for s in m["include"])
    assert sorted(f for s in files_of(m) for f in s) == ["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_f.py"]


def test_measured_durations_override_estimates(suites, tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"suites/test_d.py": 400, "suites/test_a.py": 1}))
    m = ci_cli.matrix(suites, "cpu", "per-commit", 2, durations_file=str(durations))
    assert files_of(m) == [["test_d.py"], ["test_a.py", "test_b.py", "test_c.py"]]
    # A durations file beside the suites is read by default (by the shards' pytest too).
    (suites / part.DEFAULT_DURATIONS_NAME).write_text(durations.read_text())
    assert ci_cli.matrix(suites, "cpu", "per-commit", 2) == m


def test_matrix_command_prints_one_line_of_json(suites):
    done = subprocess.run([sys.executable, "-m", "lora_conformance.ci", "matrix", "--hw", "xpu", "--suite",
                           "per-commit", "--shards", "4", "--suites-dir", str(suites)],
                          capture_output=True, text=True, check=True, cwd=suites.parent)
    assert done.stdout.count("\n") == 1  # fits one $GITHUB_OUTPUT line
    assert json.loads(done.stdout) == {"include": [
        {"shard": 0, "partition": "0/1", "files": ["suites/test_a.py"], "est_time": 5.0}]}


def test_matrix_command_rejects_unknown_suite(suites, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    ci_cli.add_arguments(parser)
    args = parser.parse_args(["matrix", "--hw", "cpu", "--suite", "weekly", "--suites-dir", str(suites)])
    assert ci_cli.run(args) == 2
    assert "unknown suite 'weekly' for hardware 'cpu'; accepted: per-commit, nightly-full" in capsys.readouterr().err


def test_list_prints_registrations_and_unregistered_files(suites, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    ci_cli.add_arguments(parser)
    assert ci_cli.run(parser.parse_args(["list", "--suites-dir", str(suites), "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert {(Path(r["file"]).name, r["hw"], r["disabled"]) for r in data["registrations"]} >= {
        ("test_a.py", "xpu", None), ("test_e.py", "cpu", "hangs on this runner")}
    assert [Path(f).name for f in data["unregistered"]] == ["test_g.py"]
    assert ci_cli.run(parser.parse_args(["list", "--suites-dir", str(suites), "--hw", "xpu"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["file", "hw", "suite", "est_time", "nightly", "disabled"]
    assert len(out) == 3 and "test_a.py" in out[1] and out[2].startswith("unregistered")
