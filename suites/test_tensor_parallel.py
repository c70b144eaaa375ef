"""Tensor parallel: an engine sharded over two devices gives the one-device answers.

LoRA under tensor parallelism shards A or B with the base layer (column-parallel q/k/v and
gate/up split B by output rows, row-parallel o_proj/down split A by input columns, and fused
qkv / gate_up layouts must keep each part's slice): a sharding error shows as a delta on the
wrong rows. All-linear adapters and base rows in one batch, tp=2 against the HF+PEFT reference
and against the same engine at tp=1. Needs two devices of the run's type; with fewer the
feature is not certified (never passed).
"""

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cuda_ci
from lora_conformance.compare import assert_logprobs_close
from lora_conformance.outcomes import LIMIT, not_certified

register_cuda_ci(est_time=120, suite="nightly-multi-gpu")

TP = 2
SPECS = {name: AdapterSpec(seed=seed, targets="all-linear", rank=16) for name, seed in (("T0", 901), ("T1", 902))}
LABELS = ["T0", None, "T1", "T0", None, "T1"]


def _devices_or_not_certified(device: str) -> None:
    from lora_conformance import devices

    kind = devices.device_type(device)
    count = devices.device_count(kind)
    if count < TP:
        not_certified(LIMIT, f"needs {TP} {kind} devices for tensor_parallel={TP}, this machine has {count}")


def _serve(lora, tp: int, reqs):
    """A fresh engine at this tensor-parallel size, closed before the next one starts (tp=1 and
    tp=2 would otherwise compete for the first device's memory)."""
    engine = lora.fresh_engine(tensor_parallel=tp)
    try:
        for name, spec in SPECS.items():
            lora.load(engine, name, spec)
        return engine.generate(reqs)
    finally:
        engine.close()


@pytest.mark.feature("parallel/tensor_parallel_matches_single",
                      "a tensor-parallel engine (tp=2) matches the reference and its own tp=1 outputs",
                      requires=("tensor_parallel",))
def test_tensor_parallel_matches_single(lora, device, dtype):
    _devices_or_not_certified(device)
    reqs = lora.requests(LABELS, max_new_tokens=12)
    refs = lora.reference(reqs, SPECS)
    lora.assert_adapter_visible(refs, reqs, label="tensor-parallel adapters vs base")
    single = _serve(lora, 1, reqs)
    sharded = _serve(lora, TP, reqs)
    lora.assert_matches_reference(sharded, refs, reqs, label=f"tp={TP}")
    for i, (a, b) in enumerate(zip(sharded, single)):
        assert_logprobs_close(a, b, lora.tolerance, label=f"request {i} (adapter={LABELS[i] or 'base'}): tp={TP} vs tp=1",
                              decode=lora.decode)
