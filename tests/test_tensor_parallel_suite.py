"""suites/test_tensor_parallel.py's plumbing, without two accelerators.

A stand-in engine declares ``tensor_parallel`` and takes the standard arg (it runs the built-in
engine whatever the size, recording each size it was given); ``devices.device_count`` is
patched to say how many devices this machine has. The suite must pass the correct stand-in
at tp=2 against tp=1, fail one whose tp=2 engine loses part of its LoRA (as a sharding bug
of fused q/k/v would: fault drop_v_proj), and report not certified with one device. The
vllm plugin passes the standard arg on as ``tensor_parallel_size``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from lora_conformance.settings import suites_dir

STAND_IN = '''
import os

from lora_conformance.engines.base import Capability
from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine


class ShardedStandIn(BuiltinEngine):
    """Runs on one device whatever it is told; SHARDING_BUG makes tp>1 drop v_proj LoRA."""
    name = "tp-stand-in"
    SHARDING_BUG = False

    def __init__(self, model_dir, device, dtype, args):
        args = dict(args)
        tp = int(args.pop("tensor_parallel", "1"))
        with open(os.environ["TP_SIZES_FILE"], "a") as f:
            f.write(f"{tp}\\n")
        if tp > 1 and self.SHARDING_BUG:
            args["fault"] = "drop_v_proj"
        super().__init__(model_dir, device, dtype, args)
        self.capabilities = self.capabilities | {Capability.TENSOR_PARALLEL}


class BuggyShardedStandIn(ShardedStandIn):
    SHARDING_BUG = True
'''


def _run(pytester, lora_settings, monkeypatch, engine_class, devices_count):
    from lora_conformance import devices

    monkeypatch.setattr(devices, "device_count", lambda kind: devices_count)
    sizes_file = pytester.path / "tp_sizes.txt"
    monkeypatch.setenv("TP_SIZES_FILE", str(sizes_file))
    pytester.makepyfile(tp_stand_in=STAND_IN)
    pytester.syspathinsert()
    sys.modules.pop("tp_stand_in", None)
    result = pytester.runpytest(str(suites_dir() / "test_tensor_parallel.py"), "--device=cpu", "--dtype=float32",
                                f"--engine=tp_stand_in:{engine_class}", f"--lora-cache={lora_settings.cache_dir}",
                                "-p", "no:cacheprovider", "-q", "-rfEs")
    sizes = [int(x) for x in sizes_file.read_text().split()] if sizes_file.exists() else []
    return result, sizes


def test_tp2_matches_tp1_on_a_correct_engine(suite_runner, lora_settings, monkeypatch):
    result, sizes = _run(suite_runner, lora_settings, monkeypatch, "ShardedStandIn", 2)
    result.assert_outcomes(passed=1)
    assert 1 in sizes and 2 in sizes, f"engine sizes requested: {sizes}"


def test_a_sharding_bug_fails_the_suite(suite_runner, lora_settings, monkeypatch):
    result, sizes = _run(suite_runner, lora_settings, monkeypatch, "BuggyShardedStandIn", 2)
    result.assert_outcomes(failed=1)
    assert "tp=2" in result.stdout.str()


def test_one_device_is_not_certified(suite_runner, lora_settings, monkeypatch):
    result, sizes = _run(suite_runner, lora_settings, monkeypatch, "ShardedStandIn", 1)
    result.assert_outcomes(skipped=1)
    assert "not certified: needs 2 cpu devices for tensor_parallel=2, this machine has 1" in result.stdout.str()
    assert 2 not in sizes


def test_builtin_is_not_certified_for_tensor_parallel(suite_runner, lora_settings):
    suite_runner.syspathinsert()
    result = suite_runner.runpytest(str(suites_dir() / "test_tensor_parallel.py"), "--device=cpu",
                                    f"--lora-cache={lora_settings.cache_dir}", "-p", "no:cacheprovider", "-q", "-rs")
    result.assert_outcomes(skipped=1)
    assert "does not declare tensor_parallel" in result.stdout.str()


def test_vllm_plugin_passes_tensor_parallel_size(monkeypatch, llama):
    from test_engine_args import _fake_vllm  # vLLM's async engine as far as start-up goes

    from lora_conformance.engines.base import Capability, EngineError
    from lora_conformance.engines.vllm_engine import VllmEngine

    _fake_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr("lora_conformance.devices.set_start_method_for", lambda device: None)
    engine = VllmEngine(llama, "cuda", "bfloat16", {"tensor_parallel": "2"})
    try:
        assert engine.llm.kwargs["tensor_parallel_size"] == 2, engine.llm.kwargs
        assert Path(engine.llm.kwargs["model"]) == Path(llama)
        assert Capability.TENSOR_PARALLEL in engine.capabilities
    finally:
        engine.close()
    with pytest.raises(EngineError, match="tensor_parallel=.0.: expected an integer >= 1"):
        VllmEngine(llama, "cuda", "bfloat16", {"tensor_parallel": "0"})
