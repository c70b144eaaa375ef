"""Fuzzing (small budget): hypothesis mutates a valid adapter directory (config fields, tensor
names, shapes, dtypes, values, the file's bytes) and loads it into builtin and peft. Every input
must be refused with a typed error or accepted, and either way leave the engine's list and its
outputs for the base and the loaded adapters bit-identical. bench/fuzz_adapters.py runs >= 500."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from lora_conformance.adapters import AdapterSpec, synthesize_adapter
from lora_conformance.adapters.fuzz import apply_mutations, mutations, try_input
from lora_conformance.judge.health import snapshot
from lora_conformance.engines import create_engine

BUDGET = 8  # per engine; the bench script runs the large budget


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory):
    return synthesize_adapter(llama, AdapterSpec(seed=4), tmp_path_factory.mktemp("fuzz") / "good")


@pytest.mark.parametrize("engine_name", ["builtin", "peft"])
def test_fuzzed_adapters_never_damage_the_engine(llama, good, engine_name):
    engine = create_engine(engine_name, llama, "cpu", "float32", {})
    engine.load_adapter("A", good)
    before = snapshot(engine, prompts=["the old man"], max_new_tokens=3)
    seen = {}

    @settings(max_examples=BUDGET, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(ops=mutations())
    def check(ops):
        with tempfile.TemporaryDirectory() as tmp:
            outcome, detail = try_input(engine, before, apply_mutations(good, Path(tmp) / "f", ops))
        seen[outcome] = seen.get(outcome, 0) + 1
        assert outcome in ("refused", "accepted"), f"{outcome} for mutations {ops}: {detail}"

    check()
    assert seen.get("refused", 0) > 0, f"no input was refused: {seen}"
    engine.close()
