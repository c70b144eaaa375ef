"""A plain install certifies: the wheel built from this checkout, installed without -e into a fresh
virtual environment, runs the bundled suites from a directory outside the checkout.

The environment sees the packages of the environment that runs the tests (a virtual environment, a
conda environment or the system Python: torch, transformers and PEFT are not downloaded), but
lora-conformance itself must come from the wheel. The certification
here is a subset of the suites, for time; bench/fresh_install.py runs the full one (results in
reports/fresh_install.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("fresh_install", Path(__file__).resolve().parents[1] / "bench" / "fresh_install.py")
fresh_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fresh_install)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp("fresh")
    wheel = fresh_install.build_wheel(work)
    python = fresh_install.make_venv(work / "venv", wheel)
    outside = work / "user"
    outside.mkdir()
    return wheel, work / "venv", python, outside


def test_the_wheel_holds_everything_certify_needs(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    root = fresh_install.ROOT
    for folder, package in (("suites", "lora_conformance/suites"), ("fixtures", "lora_conformance/fixtures")):
        for path in (root / folder).iterdir():
            if path.is_file() and path.suffix in (".py", ".json", ".txt", ".ini"):
                assert f"{package}/{path.name}" in names, f"{folder}/{path.name} is not in the wheel"
    for path in (root / "lora_conformance" / "expectations").glob("*.toml"):
        assert f"lora_conformance/expectations/{path.name}" in names
    assert "lora_conformance/autoload.py" in names and "lora_conformance/plugin.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "lora_conformance = lora_conformance.autoload" in text and "lora-conformance = lora_conformance.cli:main" in text


def test_the_package_comes_from_the_wheel(installed):
    _, venv, python, outside = installed
    where = fresh_install.package_location(python, outside)
    for key in ("package", "suites", "fixtures"):
        assert Path(where[key]).resolve().is_relative_to(venv.resolve()), f"{key}: {where[key]} is not in {venv}"
    done = subprocess.run([str(venv / "bin" / "lora-conformance"), "--version"], capture_output=True, text=True,
                          env=fresh_install.clean_env(), cwd=outside)
    assert done.returncode == 0 and str(venv.resolve()) in done.stdout


def test_the_new_environment_sees_the_running_ones_packages(installed):
    # Inside a virtual environment, --system-site-packages would give the base interpreter's packages
    # (no torch, no platformdirs there); the new environment must find the ones these tests run with.
    import importlib.util

    _, venv, python, outside = installed
    names = ("torch", "transformers", "peft", "platformdirs", "pytest", "xdist")
    code = ("import importlib.util, json; "
            f"print(json.dumps({{n: importlib.util.find_spec(n).origin for n in {names!r}}}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=fresh_install.clean_env(),
                          cwd=outside)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {n: importlib.util.find_spec(n).origin for n in names}


def test_pyargs_runs_the_installed_suites(installed):
    _, venv, python, outside = installed
    done = subprocess.run([str(python), "-m", "pytest", "--pyargs", "lora_conformance.suites", "--device=cpu", "--co",
                           "-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                          env=fresh_install.clean_env(), cwd=outside, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_nearest_reference_routing[cpu-float32-0]" in done.stdout and " tests collected" in done.stdout


def test_a_plain_install_certifies(installed, lora_settings):
    _, venv, _, outside = installed
    report = outside / "lora-report"
    env = fresh_install.clean_env(LORA_CONFORMANCE_LORA_CACHE=str(lora_settings.cache_dir))
    done = fresh_install.certify(venv, outside, report, ["-n", "1", "--", "-k", "nearest_reference_routing"],
                                 env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert str((venv / "lib").resolve()) in done.stdout  # the suites it ran are the installed ones
    data = json.loads((report / "report.json").read_text())
    records = data["records"]
    assert len(records) == 3 and all(r["nodeid"].startswith("suites/test_mixed_batch.py::") for r in records)
    assert data["verdict"]["features"]["mixed_batch/nearest_reference_routing"]["status"] == "passed"
    assert not (outside / "suites").exists()  # nothing of the checkout is needed, nor copied
    assert data["environment"]["git_commit"] is None  # a plain install has no checkout to name
