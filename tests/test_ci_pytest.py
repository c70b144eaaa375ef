"""--ci-hw/--ci-suite/--ci-nightly/--ci-partition inside pytest (CISelection), via pytester."""

from __future__ import annotations

import json
import re

import pytest

from lora_conformance.ci import cli as ci_cli

pytest_plugins = ["pytester"]

# Registers CISelection from a JSON file, without the lead's plugin (-p no:lora_conformance),
# so these tests exercise this plugin object alone.
CONFTEST = """
import json, pathlib
from types import SimpleNamespace

def pytest_configure(config):
    from lora_conformance.ci.pytest_ci import CISelection
    values = json.loads(pathlib.Path(__file__).with_name("ci.json").read_text())
    settings = SimpleNamespace(ci_hw=None, ci_suite=None, ci_nightly=False, ci_partition=None,
                               sources={"ci_suite": "command line", "ci_partition": "command line"})
    settings.__dict__.update(values)
    config.pluginmanager.register(CISelection(settings), "ci-selection")
"""

FILES = {
    "test_a": 'register_cpu_ci(est_time=100, suite="per-commit")\nregister_xpu_ci(est_time=5, suite="per-commit")\n',
    "test_b": 'register_cpu_ci(est_time=60, suite="per-commit")\n',
    "test_c": 'register_cpu_ci(est_time=50, suite="per-commit")\n',
    "test_d": 'register_cpu_ci(est_time=10, suite="per-commit")\n',
    "test_e": 'register_cpu_ci(est_time=500, suite="per-commit", disabled="hangs on this runner")\n',
    "test_f": 'register_cpu_ci(est_time=30, suite="per-commit", nightly=True)\n',
    "test_g": "",
}


@pytest.fixture
def suites(pytester):
    d = pytester.mkpydir("suites")
    for name, body in FILES.items():
        (d / f"{name}.py").write_text(
            "from lora_conformance.ci import *\n" + body
            + f"def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    return d


def run(pytester, *args, **ci):
    pytester.makeconftest(CONFTEST)
    (pytester.path / "ci.json").write_text(json.dumps(ci))
    return pytester.runpytest("-p", "no:lora_conformance", "-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-v", "suites", *args)


def ran_files(result) -> set[str]:
    return set(re.findall(r"suites/(test_\w)\.py::test_\w+ PASSED", result.stdout.str()))


def test_without_ci_hw_everything_runs(pytester, suites):
    result = run(pytester)
    result.assert_outcomes(passed=14)


def test_selects_registered_files(pytester, suites):
    result = run(pytester, ci_hw="cpu", ci_suite="per-commit")
    result.assert_outcomes(passed=8, deselected=6)
    assert ran_files(result) == {"test_a", "test_b", "test_c", "test_d"}
    result.stdout.fnmatch_lines(["ci: hw=cpu suite=per-commit nightly=False",
                                 "*disabled: suites/test_e.py: hangs on this runner"])


def test_nightly_adds_nightly_registrations(pytester, suites):
    result = run(pytester, ci_hw="cpu", ci_suite="per-commit", ci_nightly=True)
    assert ran_files(result) == {"test_a", "test_b", "test_c", "test_d", "test_f"}


def test_other_hardware(pytester, suites):
    result = run(pytester, ci_hw="xpu", ci_suite="per-commit")
    result.assert_outcomes(passed=2, deselected=12)
    assert ran_files(result) == {"test_a"}


def test_partitions_agree_with_the_matrix(pytester, suites):
    matrix = ci_cli.matrix(suites, "cpu", "per-commit", 3, nightly=True)
    seen: set[str] = set()
    for shard in matrix["include"]:
        result = run(pytester, ci_hw="cpu", ci_suite="per-commit", ci_nightly=True, ci_partition=shard["partition"])
        files = ran_files(result)
        assert files == {f.rsplit("/", 1)[-1][:-3] for f in shard["files"]}
        assert not files & seen  # shards are disjoint
        seen |= files
        result.stdout.fnmatch_lines([f"ci: * partition={shard['partition']}", f"shard {shard['partition']}: *"])
    assert seen == {"test_a", "test_b", "test_c", "test_d", "test_f"}


def test_partition_reads_durations_beside_the_suites(pytester, suites):
    (suites / "ci_durations.json").write_text(json.dumps({"suites/test_d.py": 400}))
    result = run(pytester, ci_hw="cpu", ci_suite="per-commit", ci_partition="0/2")
    assert ran_files(result) == {"test_d"}
    result.stdout.fnmatch_lines(["*durations from *ci_durations.json*"])


@pytest.mark.parametrize("ci, message", [
    ({"ci_hw": "cpu", "ci_suite": "weekly"},
     "*--ci-suite='weekly' (from command line): unknown suite for --ci-hw='cpu'; accepted values: per-commit, nightly-full"),
    ({"ci_hw": "cpu"}, "*--ci-hw='cpu' needs --ci-suite; accepted values for cpu: per-commit, nightly-full"),
    ({"ci_hw": "cpu", "ci_suite": "per-commit", "ci_partition": "2/2"},
     "*--ci-partition='2/2' (from command line): expected i/n with 0 <= i < n (e.g. 0/4), got '2/2'"),
    ({"ci_suite": "per-commit"}, "*--ci-suite need --ci-hw*"),
])
def test_bad_values_are_usage_errors(pytester, suites, ci, message):
    result = run(pytester, **ci)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_registration_error_is_a_usage_error_naming_file_and_line(pytester, suites):
    (suites / "test_h.py").write_text("import os\nfrom lora_conformance.ci import register_cpu_ci\nregister_cpu_ci(est_time=os.cpu_count(), suite='per-commit')\ndef test_h():\n    pass\n")
    result = run(pytester, ci_hw="cpu", ci_suite="per-commit")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*CI registration: *suites/test_h.py:3: argument 'est_time' must be a literal*"])


def test_with_the_project_plugin_flags(pytester, suites):
    """CI selection and the report through the real command-line flags of the lora_conformance plugin."""
    plugin = pytest.importorskip("lora_conformance.plugin", reason="lora_conformance.plugin not written yet")
    source = open(plugin.__file__).read()
    if "CISelection" not in source or "ReportRecorder" not in source:
        pytest.skip("lora_conformance.plugin does not register CISelection and ReportRecorder yet")
    # In a child process: the project plugin loads torch, which must not be re-imported in this one.
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-v", "suites",
                                           "--ci-hw=cpu", "--ci-suite=per-commit", "--ci-partition=1/2",
                                           "--lora-report=rep")
    assert ran_files(result) == {"test_b", "test_c"}
    result.assert_outcomes(passed=4, deselected=10)
    report = json.loads((pytester.path / "rep" / "report.json").read_text())
    assert sorted(report["verdict"]["features"]) == ["b/one", "b/two", "c/one", "c/two"]
    # One shard of a partition is a partial run: merged with the other shards it certifies.
    assert report["verdict"]["summary"]["certified"] is False
    assert report["verdict"]["summary"]["coverage"]["complete"] is False
    assert len(report["selection"]["deselected"]) == 10
