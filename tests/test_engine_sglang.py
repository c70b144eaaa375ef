"""The sglang engine's request and response mapping, against a stand-in ``sglang`` module.

SGLang does not run on this CPU-only machine. The stand-in follows SGLang's documented
offline API (``sglang.Engine(**server_args)``, ``generate(prompt, sampling_params,
lora_path, return_logprob, top_logprobs_num, logprob_start_len)`` returning dicts with
``text``, ``output_ids`` and ``meta_info`` whose logprob entries are ``(logprob, token_id,
text)`` tuples, ``load_lora_adapter``/``unload_lora_adapter`` returning an object with
``success``/``error_message``, ``encode``, ``shutdown``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_bert, build_llama  # noqa: E402

from lora_conformance.engines.base import (  # noqa: E402
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    CapacityError,
    EngineError,
    EngineFailure,
    UnsupportedFeatureError,
)
from lora_conformance.engines.sglang_engine import SGLangEngine  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402


class FakeUpdate:
    def __init__(self, success, error_message=None):
        self.success, self.error_message = success, error_message


class FakeEngine:
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded, self.closed = kwargs, [], {}, False
        FakeEngine.instances.append(self)

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.calls.append(("load", lora_name, lora_path, pinned))
        if lora_name in self.loaded:
            return FakeUpdate(False, f"LoRA adapter {lora_name} is already loaded")
        if "incompatible" in lora_path:
            return FakeUpdate(False, "LoRA adapter x is incompatible: rank 512 > max_lora_rank 64")
        if pinned and sum(p for p in self.loaded.values()) >= self.kwargs["max_loras_per_batch"] - 2:
            return FakeUpdate(False, "Cannot pin adapter: all slots would be pinned")
        self.loaded[lora_name] = pinned
        return FakeUpdate(True)

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload", lora_name))
        if self.loaded.pop(lora_name, None) is None:
            return FakeUpdate(False, f"LoRA adapter {lora_name} has never been loaded")
        return FakeUpdate(True)

    def generate(self, prompt=None, sampling_params=None, lora_path=None, return_logprob=False,
                 top_logprobs_num=None, logprob_start_len=None, **kw):
        self.calls.append(("generate", prompt, sampling_params, lora_path, return_logprob, top_logprobs_num,
                           logprob_start_len))
        outs = []
        for i, p in enumerate(prompt):
            n, k = sampling_params[i]["max_new_tokens"], top_logprobs_num[i]
            seed = 10 + 3 * i + (0 if lora_path[i] is None else len(lora_path[i]))
            ids = [seed + s for s in range(n)]
            top = lambda t: [(-0.25 * (j + 1), t + j, None) for j in range(k)]  # noqa: E731
            meta = {"output_token_logprobs": [(-0.25, t, None) for t in ids],
                    "output_top_logprobs": [top(t) for t in ids]}
            if logprob_start_len[i] == 0:
                prompt_ids = [1] + [4 + j for j in range(len(p.split()))]
                meta["input_token_logprobs"] = [(None, prompt_ids[0], None)] + [(-1.0, t, None) for t in prompt_ids[1:]]
                meta["input_top_logprobs"] = [None] + [top(t) for t in prompt_ids[1:]]
            outs.append({"text": f"out{i}", "output_ids": ids, "meta_info": meta})
        return outs

    def encode(self, prompt=None, lora_path=None):
        self.calls.append(("encode", prompt, lora_path))
        return [{"embedding": [3.0, 4.0] if a is None else [0.0, 2.0], "meta_info": {}} for a in lora_path]

    def shutdown(self):
        self.closed = True


@pytest.fixture
def fake_sglang(monkeypatch):
    mod = types.ModuleType("sglang")
    mod.Engine = FakeEngine
    mod.__version__ = "0.0-standin"
    monkeypatch.setitem(sys.modules, "sglang", mod)
    FakeEngine.instances = []
    return mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("sglang") / "llama")


def test_server_args(fake_sglang, model_dir):
    e = SGLangEngine(model_dir, "cpu", "bfloat16", {"max_loras_per_batch": "4", "lora_backend": "triton",
                                                    "lora_eviction_policy": "fifo", "lora_target_modules": "q_proj,v_proj"})
    kw = FakeEngine.instances[0].kwargs
    assert kw["model_path"] == str(model_dir) and kw["enable_lora"] is True
    assert (kw["max_loras_per_batch"], kw["max_loaded_loras"], kw["max_lora_rank"]) == (5, 16, 64)
    assert (kw["lora_backend"], kw["lora_eviction_policy"], kw["device"], kw["dtype"]) == ("triton", "fifo", "cpu", "bfloat16")
    assert kw["lora_target_modules"] == ["q_proj", "v_proj"]
    assert e.limits.max_loras_per_batch == 4  # SGLang counts the base as one slot: it was given 5
    assert Capability.EVICTION_FIFO in e.capabilities and Capability.EVICTION_LRU not in e.capabilities
    assert e.version() == "sglang 0.0-standin"
    e.close()
    e.close()
    assert FakeEngine.instances[0].closed
    with pytest.raises(EngineFailure, match="closed"):
        e.generate([GenerationRequest("a dog")])


def test_bad_args(fake_sglang, model_dir):
    with pytest.raises(EngineError, match="unknown engine argument"):
        SGLangEngine(model_dir, "cpu", "float32", {"max_loras": "4"})
    with pytest.raises(EngineError, match="lru or fifo"):
        SGLangEngine(model_dir, "cpu", "float32", {"lora_eviction_policy": "random"})


def test_missing_sglang_is_a_clear_failure(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(EngineFailure, match="needs SGLang installed"):
        SGLangEngine(model_dir, "cpu", "float32", {})


def test_generate_mapping(fake_sglang, model_dir):
    e = SGLangEngine(model_dir, "cpu", "float32", {})
    e.load_adapter("a1", Path("/adapters/a1"))
    reqs = [GenerationRequest("the cat sat", "a1", 3, 2, prompt_logprobs=True, ignore_eos=False),
            GenerationRequest("a dog", None, 2, 3)]
    res = e.generate(reqs)
    call = FakeEngine.instances[0].calls[-1]
    assert call == ("generate", ["the cat sat", "a dog"],
                    [{"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": False},
                     {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}],
                    ["a1", None], True, [2, 3], [0, -1])
    assert res[0].token_ids == [12, 13, 14] and res[1].token_ids == [13, 14]
    assert res[0].logprobs[0] == {12: -0.25, 13: -0.5}
    assert len(res[1].logprobs[0]) == 3
    assert res[0].prompt_token_ids == [1, 4, 5, 6]
    assert res[0].prompt_logprobs == [{4: -0.25, 5: -0.5}, {5: -0.25, 6: -0.5}, {6: -0.25, 7: -0.5}]
    assert res[1].prompt_logprobs is None and res[1].prompt_token_ids == [1, 5, 7]  # local tokenizer: a=5, dog=7
    assert res[0].text == "out0"


def test_adapter_lifecycle_and_errors(fake_sglang, model_dir):
    e = SGLangEngine(model_dir, "cpu", "float32", {"max_loras_per_batch": "2"})
    fake = FakeEngine.instances[0]
    e.load_adapter("a1", Path("/adapters/a1"), pinned=True)
    e.load_adapter("a1", Path("/adapters/a1-v2"))  # reload: unload first, SGLang refuses a loaded name
    assert fake.calls[-2:] == [("unload", "a1"), ("load", "a1", "/adapters/a1-v2", False)]
    with pytest.raises(AdapterIncompatibleError, match="incompatible"):
        e.load_adapter("bad", Path("/adapters/incompatible"))
    e.load_adapter("p", Path("/adapters/p"), pinned=True)
    with pytest.raises(CapacityError, match="pinned"):
        e.load_adapter("q", Path("/adapters/q"), pinned=True)
    assert e.list_adapters() == ["a1", "p"]
    e.unload_adapter("a1")
    with pytest.raises(AdapterNotLoadedError):
        e.unload_adapter("a1")
    with pytest.raises(AdapterNotLoadedError):
        e.generate([GenerationRequest("a dog", "a1")])
    fake.generate = lambda **kw: (_ for _ in ()).throw(RuntimeError("scheduler died"))
    with pytest.raises(EngineFailure, match="scheduler died"):
        e.generate([GenerationRequest("a dog")])
    with pytest.raises(UnsupportedFeatureError):
        e.embed(["a dog"])


def test_embeddings(fake_sglang, tmp_path):
    e = SGLangEngine(build_bert(tmp_path / "bert"), "cpu", "float32", {})
    assert FakeEngine.instances[0].kwargs["is_embedding"] is True
    assert Capability.EMBEDDINGS in e.capabilities and Capability.MIXED_BATCH not in e.capabilities
    e.load_adapter("enc", Path("/adapters/enc"))
    assert e.embed(["a", "b"]) == [[0.6, 0.8], [0.6, 0.8]]
    assert e.embed(["a"], "enc") == [[0.0, 1.0]]
    assert FakeEngine.instances[0].calls[-1] == ("encode", ["a"], ["enc"])
