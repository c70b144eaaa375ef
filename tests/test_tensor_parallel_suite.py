"""suites/test_tensor_parallel.py's plumbing, and the built-in engine's tensor parallelism.

A stand-in engine declares ``tensor_parallel`` and takes the standard arg (it runs the built-in
engine at one rank whatever the size, recording each size it was given); ``devices.parallel_ranks``
is patched to say how many ranks this machine runs. The suite must pass the correct stand-in
at tp=2 against tp=1, fail one whose tp=2 engine loses part of its LoRA (fault drop_v_proj),
and report not certified with one rank. The vllm plugin passes the standard arg on as
``tensor_parallel_size``. The built-in engine itself shards over gloo processes on cpu: the
suite passes it (the negative control; tests/test_detection_power.py shows each sharding fault
caught), and closing it leaves no worker process behind.
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
        args.pop("tensor_parallel_size", None)
        with open(os.environ["TP_SIZES_FILE"], "a") as f:
            f.write(f"{tp}\\n")
        if tp > 1 and self.SHARDING_BUG:
            args["fault"] = "drop_v_proj"
        super().__init__(model_dir, device, dtype, args)
        self.capabilities = self.capabilities | {Capability.TENSOR_PARALLEL}


class BuggyShardedStandIn(ShardedStandIn):
    SHARDING_BUG = True
'''


def _run(pytester, lora_settings, monkeypatch, engine_class, ranks):
    from lora_conformance import devices

    monkeypatch.setattr(devices, "parallel_ranks", lambda kind: ranks)
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
    assert "not certified: needs 2 cores (ranks are processes) for tensor_parallel=2, this machine has 1" in \
        result.stdout.str()
    assert 2 not in sizes


def test_builtin_shards_over_two_ranks_and_passes(suite_runner, lora_settings):
    """The negative control: the correct built-in engine at tp=2 (two gloo processes) passes."""
    result = suite_runner.runpytest(str(suites_dir() / "test_tensor_parallel.py"), "--device=cpu",
                                    f"--lora-cache={lora_settings.cache_dir}", "-p", "no:cacheprovider", "-q", "-rfEs")
    result.assert_outcomes(passed=1)


def test_builtin_tp_args_settings_and_close_leave_no_worker(llama):
    """tensor_parallel_size (and the standard tensor_parallel, which wins over it) set the ranks; the
    effective size is in settings(); close() ends the worker process."""
    import multiprocessing

    from lora_conformance.engines.base import Capability
    from lora_conformance.engines.builtin import BuiltinEngine

    cfg = BuiltinEngine.parse_args({"tensor_parallel_size": "2", "tensor_parallel": "1"})
    assert cfg.tensor_parallel_size == 1
    assert BuiltinEngine.parse_args({"tensor_parallel": "2"}).tensor_parallel_size == 2
    before = set(multiprocessing.active_children())
    engine = BuiltinEngine(llama, "cpu", "float32", {"tensor_parallel_size": "2"})
    try:
        workers = [p for p in multiprocessing.active_children() if p not in before]
        assert len(workers) == 1 and workers[0].is_alive()
        assert engine.settings()["effective"]["tensor_parallel_size"] == 2
        assert engine.settings()["effective"]["collective_backend"] == "gloo"
        assert Capability.TENSOR_PARALLEL in engine.capabilities
    finally:
        engine.close()
    assert not workers[0].is_alive(), "close() leaves the worker running"
    assert not [p for p in multiprocessing.active_children() if p not in before]


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
