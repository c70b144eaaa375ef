"""Installed, the plugin leaves other projects' pytest runs alone, and still runs the suites when asked.

A foreign project with its own ``--device`` option and ``device`` fixture (many public projects have
both) runs unchanged: no option clash, its fixture is not replaced, no report header, nothing
written into our cache. The suites keep working: ``pytest suites``, ``-p lora_conformance.plugin``,
``--pyargs lora_conformance.suites``, and ``lora-conformance certify`` from inside that project.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from lora_conformance import autoload
from lora_conformance import launch as certify
from lora_conformance.settings import suites_dir

FOREIGN_CONFTEST = """
import pytest

def pytest_addoption(parser):
    parser.addoption("--device", default="foreign-default", help="the foreign project's own device option")

@pytest.fixture
def device(request):
    return request.config.getoption("--device")

@pytest.fixture
def dtype():
    return "foreign-dtype"
"""

FOREIGN_TEST = """
def test_gets_its_own_values(device, dtype, request):
    print("SEEN", device, dtype)
    assert device == "foreign-xpu" and dtype == "foreign-dtype"
    assert request.config.pluginmanager.get_plugin("lora_conformance.plugin") is None
    assert not any(name.startswith("lora-conformance") for name, _ in request.config.pluginmanager.list_name_plugin())
"""


@pytest.fixture
def foreign(pytester, monkeypatch, tmp_path):
    """A foreign project, run as in an environment where lora-conformance is installed: entry points
    auto-load, and nothing asks for our plugin (this repository's tests load it through PYTEST_PLUGINS)."""
    monkeypatch.delenv("PYTEST_PLUGINS", raising=False)
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "our-cache"))
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.makepyfile(test_foreign=FOREIGN_TEST)
    return pytester


def test_the_entry_point_is_the_inert_module():
    eps = [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "lora_conformance"]
    assert eps, "lora-conformance's pytest11 entry point is not installed"
    assert {ep.value for ep in eps} == {"lora_conformance.autoload"}, (
        f"{[ep.value for ep in eps]}: installed metadata is stale; reinstall (pip install -e .)")


def test_a_foreign_project_runs_unchanged(foreign, tmp_path):
    # In a process of its own, as a foreign project runs: an in-process run would inherit what
    # earlier tests of this worker loaded (our suites' Hypothesis profile among them).
    result = foreign.runpytest_subprocess("--device=foreign-xpu", "-s", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*SEEN foreign-xpu foreign-dtype*"])
    # pytest's own "plugins: lora-conformance-0.1.0, ..." line names every installed plugin; ours adds none.
    assert not [line for line in result.outlines if "lora-conformance" in line and not line.startswith("plugins:")]
    assert "option dest 'device' already used" not in result.errlines and result.ret == 0
    assert not (tmp_path / "our-cache").exists()  # no durations (nor anything else) written into our cache


def test_a_foreign_project_sees_no_options_or_fixtures_of_ours(foreign):
    help_text = "\n".join(foreign.runpytest("--help").outlines)
    assert "--engine-arg" not in help_text and "--lora-report" not in help_text and "LoRA conformance" not in help_text
    fixtures = "\n".join(foreign.runpytest("--fixtures").outlines)
    assert "lora_harness" not in fixtures and "lora_settings" not in fixtures


def test_asked_for_the_plugin_works_in_the_same_environment(pytester, monkeypatch, tmp_path):
    """-p lora_conformance.plugin gives a project our options, fixtures and header."""
    monkeypatch.delenv("PYTEST_PLUGINS", raising=False)
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    pytester.makepyfile(test_ours="""
def test_settings(lora_settings, device, dtype):
    assert lora_settings.engine == "builtin" and device == "cpu" and dtype == "float32"
""")
    result = pytester.runpytest("-p", "lora_conformance.plugin", "--device=cpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["lora-conformance: engine=builtin device=cpu*"])


@pytest.mark.parametrize("args, expected", [
    (["lora_conformance.suites"], True),
    (["lora_conformance.suites.test_moe::test_expert_lora_mixed_batch"], True),
    (["lora_conformance"], False),
    (["lora_conformance.suitesx"], False),
    (["tests"], False),
])
def test_pyargs_naming_the_suites_activates_the_plugin(args, expected):
    assert autoload.names_our_suites(args, pyargs=True) is expected
    assert autoload.names_our_suites(args, pyargs=False) is False


def test_the_suites_run_from_inside_a_foreign_project(foreign, tmp_path):
    """From a project whose conftest.py has its own --device: the suites' own ways of running still
    collect, certify's pytest command (its own ini, rootdir and confcutdir) and --pyargs alike."""
    env_cmd = certify.pytest_command(_certify_args("--device", "cpu", "--report", str(tmp_path / "rep")))
    done = subprocess.run([*env_cmd, "--co", "-q", "-k", "test_moe"], cwd=foreign.path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "suites/test_moe.py::test_expert_lora_mixed_batch[cpu-float32]" in done.stdout
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
                           "lora_conformance.suites.test_moe", "--device=cpu", "--co", "-q",
                           f"--rootdir={suites_dir().parent}", "--confcutdir", str(suites_dir())],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_expert_lora_mixed_batch[cpu-float32]" in done.stdout


def _certify_args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    return parser.parse_args(list(argv))
