"""With ``validate_adapters=1`` the vllm plugin validates an adapter before vLLM sees it; it restores the previous adapter when
vLLM refuses a reload (no vLLM needed: a recording stand-in for ``llm.llm_engine``)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_conformance.adapters import AdapterSpec, synthesize_adapter
from lora_conformance.adapters.malformed import MALFORMED, make_malformed
from lora_conformance.engines.base import AdapterFormatError, AdaptersInUse, EngineError
from lora_conformance.engines.vllm_engine import VllmEngine


class RecordingLlmEngine:
    """AsyncLLM's adapter calls, recorded."""

    def __init__(self):
        self.calls, self.loras = [], {}

    async def add_lora(self, req):
        self.calls.append(("add", req.lora_name, req.lora_path))
        if "refused-by-vllm" in req.lora_path:
            raise ValueError("LoRA rank 64 is greater than max_lora_rank 8.")
        self.loras[req.lora_int_id] = req.lora_path
        return True

    async def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))
        return self.loras.pop(lora_id, None) is not None


def _engine(model_dir) -> VllmEngine:
    e = VllmEngine.__new__(VllmEngine)
    e.max_lora_rank, e.dev_type, e._dead, e.model_dir = 8, "cpu", None, Path(model_dir)
    e.validate_adapters, e.dtype = True, "float32"
    e._in_use = AdaptersInUse()
    e._ids, e._infos, e._next_id = {}, {}, 1
    e.llm = RecordingLlmEngine()
    e._loop = SimpleNamespace(run=lambda coro, timeout=None: asyncio.run(coro))
    e._request = lambda name: SimpleNamespace(lora_name=name, lora_int_id=e._ids[name],
                                              lora_path=str(e._infos[name].path))
    return e


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory):
    return synthesize_adapter(llama, AdapterSpec(seed=2), tmp_path_factory.mktemp("v") / "good")


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_adapters_never_reach_vllm(llama, good, tmp_path, kind):
    e = _engine(llama)
    with pytest.raises(AdapterFormatError):
        e.load_adapter("x", make_malformed(kind, good, tmp_path / kind, 8))
    assert e.llm.calls == [] and e.list_adapters() == []


def test_a_refused_reload_restores_the_previous_adapter(llama, good, tmp_path):
    e = _engine(llama)
    e.load_adapter("x", good)
    refused = shutil.copytree(good, tmp_path / "refused-by-vllm")
    with pytest.raises(EngineError):
        e.load_adapter("x", refused)
    assert e.list_adapters() == ["x"]
    assert list(e.llm.loras.values()) == [str(good)], e.llm.calls
