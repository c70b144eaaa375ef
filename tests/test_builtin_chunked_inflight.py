"""The built-in engine's chunked prefill, explicit prefill LoRA paths and concurrent serving: each
configuration gives the unchunked, one-thread engine's outputs (which test_builtin_engine.py ties
to HF + PEFT), and adapter changes drain the requests that use the name."""

from __future__ import annotations

import threading

import pytest

from _builtin_models import build_adapter, build_decoder
from lora_conformance.engines.base import AdapterNotLoadedError, Capability
from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.types import GenerationRequest

LONG = "one two three four five six seven eight nine ten and the cat sat on the mat while a dog ran fast"
PROMPTS = [LONG, "red blue green", LONG + " again and again", "the cat sat on the mat"]
NAMES = ["a1", None, "a2", "a1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("builtin_chunked")
    base = build_decoder(d / "base", seed=3)
    return base, {"a1": build_adapter(base, d / "a1", 1), "a2": build_adapter(base, d / "a2", 2, r=4, alpha=8)}


@pytest.fixture(scope="module")
def whole(world):
    """The unchunked engine's outputs (default lora_backend: segmented on cpu)."""
    return run(world, {}, max_new=12)


def run(world, args, names=NAMES, prompts=PROMPTS, max_new=6):
    base, ads = world
    with BuiltinEngine(base, "cpu", "float32", args) as eng:
        for n in {n for n in names if n}:
            eng.load_adapter(n, ads[n])
        reqs = [GenerationRequest(p, n, max_new_tokens=max_new, top_k=3, prompt_logprobs=True)
                for p, n in zip(prompts, names)]
        return eng.generate(reqs), dict(eng.llm.steps)


def assert_same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"{what}, request {i}: tokens {x.token_ids} != {y.token_ids}"
        for rows_x, rows_y in ((x.logprobs, y.logprobs), (x.prompt_logprobs, y.prompt_logprobs)):
            assert len(rows_x) == len(rows_y), f"{what}, request {i}: {len(rows_x)} rows != {len(rows_y)}"
            for rx, ry in zip(rows_x, rows_y):
                assert rx.keys() == ry.keys() and max(abs(rx[k] - ry[k]) for k in rx) < 1e-4, (what, i, rx, ry)


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_one_step(world, whole, chunk):
    chunked, steps = run(world, {"chunked_prefill_size": str(chunk)}, max_new=12)
    assert_same(chunked, whole[0], f"chunked_prefill_size={chunk}")
    assert whole[1]["prefill"] == 1 and steps["prefill"] > 1, (whole[1], steps)


def test_chunked_prefill_survives_preemption(world, whole):
    """Few KV blocks: sequences are preempted and recomputed, across chunk boundaries too."""
    tight, _ = run(world, {"chunked_prefill_size": "5", "kv_block_size": "4", "num_kv_blocks": "20"}, max_new=12)
    assert_same(tight, whole[0], "chunked with preemption")


def test_masked_lora_backend_equals_segmented(world, whole):
    assert_same(run(world, {"lora_backend": "masked"}, max_new=12)[0], whole[0], "lora_backend=masked")


def test_engine_args_are_validated(world):
    base, _ = world
    with pytest.raises(ValueError, match="lora_backend='bgmv'.*segmented, masked"):
        BuiltinEngine(base, "cpu", "float32", {"lora_backend": "bgmv"})
    with pytest.raises(ValueError, match="chunked_prefill_size='-1'"):
        BuiltinEngine(base, "cpu", "float32", {"chunked_prefill_size": "-1"})
    assert BuiltinEngine.backends("cpu") == {"lora_backend": ("segmented", "masked")}


def test_submit_and_threads_equal_one_batch(world):
    base, ads = world
    reqs = [GenerationRequest(p, n, max_new_tokens=6, top_k=3) for p, n in zip(PROMPTS, NAMES)]
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        assert Capability.INFLIGHT_LIFECYCLE in eng.capabilities
        for n in ("a1", "a2"):
            eng.load_adapter(n, ads[n])
        alone = [eng.generate([r])[0] for r in reqs]
        handles = [eng.submit([r]) for r in reqs]
        from_threads = [None] * len(reqs)

        def go(i):
            from_threads[i] = eng.generate([reqs[i]])[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, h in enumerate(handles):
            assert [x.token_ids for x in h.result(60)] == [alone[i].token_ids], f"submitted request {i}"
            assert from_threads[i].token_ids == alone[i].token_ids, f"request {i} from a thread"


def test_unload_waits_for_running_requests_then_refuses_new_ones(world):
    base, ads = world
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.load_adapter("a1", ads["a1"])
        expected = eng.generate([GenerationRequest(LONG, "a1", max_new_tokens=40)])[0].token_ids
        handle = eng.submit([GenerationRequest(LONG, "a1", max_new_tokens=40)])
        assert handle.wait_started(60)
        eng.unload_adapter("a1")
        assert handle.done(), "unload returned while a request using the adapter was running"
        assert handle.result(1)[0].token_ids == expected
        with pytest.raises(AdapterNotLoadedError):
            eng.submit([GenerationRequest(LONG, "a1", max_new_tokens=2)])
