"""An engine that refuses to start (UnsupportedFeatureError: a model, dtype or engine arg it cannot
serve) makes the test *not certified* with cause ``refused``, never failed or errored, and the
refusal is remembered instead of retried for every test."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_conformance.engines import Engine, UnsupportedFeatureError
from lora_conformance.harness import Harness
from lora_conformance.outcomes import REFUSED, NotCertified
from lora_conformance.settings import Settings

STARTS = []


class RefusingEngine(Engine):
    name = "refusing"

    def __init__(self, model_dir, device, dtype, args):
        STARTS.append(dict(args))
        raise UnsupportedFeatureError(f"cannot run with {dict(args)}")

    def load_adapter(self, name, path, pinned=False): ...
    def unload_adapter(self, name): ...
    def list_adapters(self): return []
    def generate(self, requests): return []


def _harness(tmp_path: Path) -> Harness:
    return Harness(Settings(device="cpu", device_spec="cpu", engine=f"{__name__}:RefusingEngine",
                            engine_args={"user": "1"}, base_model="synthetic:llama", dtype="float32",
                            reference_device="cpu", reference_dtype="float32", cache_dir=tmp_path,
                            refresh_references=False, report_dir=None, expectations=None))


def test_refused_start_is_not_certified_with_its_cause(tmp_path):
    harness = _harness(tmp_path)
    with pytest.raises(NotCertified) as exc:
        harness.create_engine(tmp_path, "float32", {"eviction": "fifo"})
    assert exc.value.cause == REFUSED, exc.value.cause
    assert "eviction=fifo" in exc.value.detail and "cannot run with" in exc.value.detail, exc.value.detail


def test_refused_shared_engine_is_not_retried(tmp_path):
    harness = _harness(tmp_path)
    STARTS.clear()
    for _ in range(2):
        with pytest.raises(NotCertified):
            harness.shared_engine(tmp_path, "float32", {"graphs": "1"})
    assert len(STARTS) == 1, f"engine started {len(STARTS)} times, expected 1 (refusal remembered)"
