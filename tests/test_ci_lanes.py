"""Every CI lane selects something: each workflow job in ci/workflows/, for each event that
triggers it, names a hardware kind and a suite for which ``ci matrix`` selects at least one
file; and every hardware kind CI knows (cpu, cuda, xpu, npu) selects files for every suite a
workflow names, per-commit and nightly alike. The nightly suite includes per-commit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the workflows (pip install pyyaml)")

from lora_conformance.ci.cli import matrix  # noqa: E402
from lora_conformance.ci.registry import collect, select, suite_files, suites_for  # noqa: E402
from lora_conformance.devices import CPU, CUDA, NPU, XPU  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "ci" / "workflows"
SUITES_DIR = ROOT / "suites"
HARDWARE = (CPU, CUDA, XPU, NPU)
# What a workflow's expressions may contain: github.event_name, string literals, ==, &&, ||, !, ( ).
_EXPR_OK = re.compile(r"^(\s|github\.event_name|'[^']*'|==|!=|&&|\|\||!|\(|\)|true|false)*$")


def evaluate(value, event: str):
    """A workflow value as GitHub would give it for ``event``: plain values unchanged, ``${{ ... }}``
    evaluated. Only the small grammar the templates use is accepted (anything else fails the test)."""
    if not isinstance(value, str) or "${{" not in value:
        return value
    expr = value.strip()
    assert expr.startswith("${{") and expr.endswith("}}"), f"mixed text and expression: {value!r}"
    expr = expr[3:-2].strip()
    assert _EXPR_OK.match(expr), f"expression outside the grammar this test evaluates: {expr!r}"
    words = {"&&": " and ", "||": " or ", "!": " not ", "true": "True", "false": "False",
             "github.event_name": repr(event)}
    py = re.sub(r"'[^']*'|==|!=|&&|\|\||!|true|false|github\.event_name", lambda m: words.get(m.group(0), m.group(0)), expr)
    return eval(py, {"__builtins__": {}}, {})  # noqa: S307 - grammar checked above


def lanes() -> list[tuple[str, str, str, bool]]:
    """(workflow:job@event, hw, suite, nightly) for every caller job and triggering event."""
    out = []
    for path in sorted(WORKFLOWS.glob("*.yml")):
        wf = yaml.safe_load(path.read_text())
        triggers = wf.get(True, wf.get("on"))
        if "workflow_call" in triggers:
            continue  # the reusable workflow itself
        if not all("uses" in job for job in wf["jobs"].values()):
            continue  # a standalone workflow (transformers-newest.yml runs tests/, no suite selection)
        events = list(triggers) if isinstance(triggers, dict) else list(triggers)
        for job_name, job in wf["jobs"].items():
            for event in events:
                if "if" in job and not evaluate("${{ " + job["if"] + " }}", event):
                    continue
                given = job["with"]
                hw = evaluate(given.get("hw"), event) or evaluate(given["device"], event)
                suite = evaluate(given.get("suite", "per-commit"), event)
                nightly = evaluate(given.get("nightly", False), event)
                nightly = nightly if isinstance(nightly, bool) else str(nightly).lower() == "true"
                out.append((f"{path.name}:{job_name}@{event}", hw, suite, nightly))
    return out


LANES = lanes()


def test_the_expression_reader_follows_github():
    expr = "${{ github.event_name == 'schedule' && 'nightly-full' || 'per-commit' }}"
    assert evaluate(expr, "schedule") == "nightly-full" and evaluate(expr, "push") == "per-commit"
    assert evaluate("${{ github.event_name == 'schedule' }}", "push") is False
    assert evaluate("${{ github.event_name != 'push' }}", "push") is False
    assert evaluate("cuda", "push") == "cuda"
    with pytest.raises(AssertionError, match="grammar"):
        evaluate("${{ inputs.suite }}", "push")


def test_lanes_are_read_from_every_caller():
    names = {lane[0].split(":")[0] for lane in LANES}
    assert {"cpu.yml", "cuda.yml", "xpu.yml", "sglang-cuda.yml", "sglang-xpu.yml", "vllm-cuda.yml"} <= names, names
    assert ("vllm-cuda.yml:multi-gpu@push" not in {lane[0] for lane in LANES}), "the multi-GPU job runs nightly only"
    assert ("cpu.yml:conformance@schedule", "cpu", "nightly-full", True) in LANES


@pytest.mark.parametrize("lane, hw, suite, nightly", LANES, ids=[lane[0] for lane in LANES])
def test_every_lane_selects_files(lane, hw, suite, nightly):
    result = matrix(SUITES_DIR, hw, suite, shards=1, nightly=nightly)
    files = [f for shard in result["include"] for f in shard["files"]]
    assert files, f"{lane}: `ci matrix --hw {hw} --suite {suite}{' --nightly' if nightly else ''}` selects no file"


def _named_suites() -> list[str]:
    return sorted({suite for _, _, suite, _ in LANES})


@pytest.mark.parametrize("hw", HARDWARE)
@pytest.mark.parametrize("nightly", [False, True], ids=["per-commit-run", "nightly-run"])
def test_every_hardware_selects_files_for_every_named_suite(hw, nightly):
    """Every suite a workflow names that this hardware kind declares (registry.SUITES)."""
    suites = [s for s in _named_suites() if s in suites_for(hw)]
    assert "per-commit" in suites and "nightly-full" in suites, suites
    empty = [s for s in suites
             if not [f for shard in matrix(SUITES_DIR, hw, s, 1, nightly)["include"] for f in shard["files"]]]
    assert not empty, f"ci matrix --hw {hw}{' --nightly' if nightly else ''} selects no file for suites {empty}"


@pytest.mark.parametrize("hw", HARDWARE)
def test_nightly_is_a_superset_of_per_commit(hw):
    registry = collect(suite_files(SUITES_DIR))
    per_commit, _ = select(registry, hw, "per-commit", nightly=False)
    nightly, _ = select(registry, hw, "nightly-full", nightly=True)
    missing = sorted(p.name for p in set(per_commit) - set(nightly))
    assert not missing, f"{hw}: per-commit files missing from nightly-full: {missing}"
