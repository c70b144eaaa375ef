"""The built-in engine's serving machinery: engine args, adapter pool (eviction, pinning,
reload), scheduling under scarce slots / KV blocks, prefix cache, determinism."""

from __future__ import annotations

import json
import shutil

import pytest

from _builtin_models import build_adapter, build_decoder
from lora_conformance.engines.base import (AdapterIncompatibleError, AdapterNotLoadedError, CapacityError,
                                           Capability, UnsupportedFeatureError)
from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.types import GenerationRequest

LONG = "the cat sat on the mat and the dog ran fast to the big red tree by the sea"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("builtin_pool")
    base = build_decoder(d / "base", seed=1)
    ads = {f"a{i}": build_adapter(base, d / f"a{i}", 10 + i, r=4 + i, alpha=8) for i in range(4)}
    return base, ads, d


def reqs(names, prompt=LONG, n=4, **kw):
    return [GenerationRequest(prompt, a, max_new_tokens=n, top_k=3, **kw) for a in names]


def close(r1, r2, tol=1e-5):
    assert r1.token_ids == r2.token_ids
    for a, b in zip(r1.logprobs, r2.logprobs):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) <= tol


def test_engine_args_are_validated(setup):
    base, _, _ = setup
    with pytest.raises(ValueError, match="unknown engine argument 'bogus'"):
        BuiltinEngine(base, "cpu", "float32", {"bogus": "1"})
    with pytest.raises(ValueError, match="eviction='random'.*lru or fifo"):
        BuiltinEngine(base, "cpu", "float32", {"eviction": "random"})
    with pytest.raises(ValueError, match="max_rank='x'"):
        BuiltinEngine(base, "cpu", "float32", {"max_rank": "x"})
    with pytest.raises(ValueError, match="(?s)unknown fault 'nope'.*delta_twice"):
        BuiltinEngine(base, "cpu", "float32", {"fault": "nope"})
    with pytest.raises(UnsupportedFeatureError, match="graphs=1"):
        BuiltinEngine(base, "cpu", "float32", {"graphs": "1"})


def test_capabilities_limits_version(setup):
    base, _, _ = setup
    with BuiltinEngine(base, "cpu", "float32", {"max_loras_per_batch": "3", "max_rank": "32"}) as eng:
        assert eng.capabilities == {Capability(c) for c in (
            "mixed_batch", "dynamic_loading", "pinning", "eviction_lru", "eviction_fifo", "max_loaded",
            "prefix_cache", "overlap_loading", "rslora", "rank_pattern", "embed_tokens", "lm_head",
            "prompt_logprobs", "chunked_prefill", "inflight_lifecycle", "tensor_parallel")}
        assert (eng.limits.max_loras_per_batch, eng.limits.max_loaded_loras, eng.limits.max_rank) == (3, 8, 32)
        assert eng.version().startswith("lora-conformance builtin ")
    with BuiltinEngine(base, "cpu", "float32", {"prefix_cache": "0", "overlap_loading": "0"}) as eng:
        assert not eng.supports("prefix_cache") and not eng.supports("overlap_loading")


def test_adapter_errors(setup, tmp_path):
    base, ads, _ = setup
    with BuiltinEngine(base, "cpu", "float32", {"max_rank": "4"}) as eng:
        with pytest.raises(AdapterIncompatibleError, match=rf"{ads['a1']}.*\br\b.*rank 5.*max_rank=4"):
            eng.load_adapter("big", ads["a1"])
        eng.load_adapter("ok", ads["a0"])
        with pytest.raises(AdapterNotLoadedError, match="'missing'"):
            eng.generate(reqs(["missing"]))
        eng.unload_adapter("ok")
        with pytest.raises(AdapterNotLoadedError):
            eng.unload_adapter("ok")
        assert eng.list_adapters() == []
        bad = tmp_path / "bad"
        shutil.copytree(ads["a0"], bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["target_modules"] = ["q_proj", "foo_proj"]
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(AdapterIncompatibleError, match=r"bad.*target_modules.*foo_proj"):
            eng.load_adapter("bad", bad)
        for field_, value, what in (("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save"),
                                    ("bias", "all", "bias")):
            c = dict(json.loads((ads["a0"] / "adapter_config.json").read_text()), **{field_: value})
            (bad / "adapter_config.json").write_text(json.dumps(c))
            with pytest.raises(UnsupportedFeatureError, match=rf"{what}.*{bad}"):
                eng.load_adapter("bad", bad)


@pytest.mark.parametrize("policy,victim", [("lru", "a1"), ("fifo", "a0")])
def test_host_cache_eviction(setup, policy, victim):
    base, ads, _ = setup
    args = {"max_loras_per_batch": "1", "max_loaded_loras": "2", "eviction": policy}
    with BuiltinEngine(base, "cpu", "float32", args) as eng:
        eng.load_adapter("a0", ads["a0"])
        eng.load_adapter("a1", ads["a1"])
        before = eng.generate(reqs(["a0", "a1"]))
        eng.generate(reqs(["a0"]))  # a0 used last: lru keeps it, fifo does not care
        eng.load_adapter("a2", ads["a2"])
        assert victim not in eng.resident_adapters() and len(eng.resident_adapters()) == 2
        assert sorted(eng.list_adapters()) == ["a0", "a1", "a2"]  # evicted, not forgotten
        after = eng.generate(reqs(["a0", "a1"]))  # re-read from disk on use
        for x, y in zip(before, after):
            close(x, y)


def test_slot_eviction_order(setup):
    base, ads, _ = setup
    # a0 then a1 enter the slots in that order (one batch each: the order of slot assignment inside
    # one batch is the scheduler's), a0 is used again, then a2 needs a slot.
    for policy, expect in (("lru", {"a0", "a2"}), ("fifo", {"a1", "a2"})):
        with BuiltinEngine(base, "cpu", "float32", {"max_loras_per_batch": "2", "eviction": policy}) as eng:
            for n in ("a0", "a1", "a2"):
                eng.load_adapter(n, ads[n])
            eng.generate(reqs(["a0"], n=1))
            eng.generate(reqs(["a1"], n=1))
            eng.generate(reqs(["a0"], n=1))
            eng.generate(reqs(["a2"], n=1))
            assert set(eng.slot_adapters()) == expect, (policy, eng.slot_adapters())


def test_pinning(setup):
    base, ads, _ = setup
    with BuiltinEngine(base, "cpu", "float32", {"max_loras_per_batch": "2", "max_loaded_loras": "3"}) as eng:
        eng.load_adapter("a0", ads["a0"], pinned=True)
        with pytest.raises(CapacityError, match="no device slot for unpinned"):
            eng.load_adapter("a1", ads["a1"], pinned=True)
        for n in ("a1", "a2", "a3"):
            eng.load_adapter(n, ads[n])
        assert "a0" in eng.resident_adapters()  # pinned survives host eviction
        eng.generate(reqs(["a0"], n=1))
        for n in ("a1", "a2", "a3", "a1"):
            eng.generate(reqs([n], n=1))
            assert "a0" in eng.slot_adapters()  # and slot eviction


def test_reload_takes_effect(setup):
    base, ads, _ = setup
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.load_adapter("ref", ads["a2"])
        want = eng.generate(reqs(["ref"]))[0]
        eng.load_adapter("x", ads["a1"])
        first = eng.generate(reqs(["x"]))[0]
        eng.load_adapter("x", ads["a2"])
        second = eng.generate(reqs(["x"]))[0]
    assert first.logprobs != second.logprobs
    close(second, want)


def test_scarce_slots_and_kv_blocks_split_batches(setup):
    base, ads, _ = setup
    names = ["a0", None, "a1", "a2", "a0", "a3", None]
    prompts = [LONG, "red blue", LONG[:30], "one two three", LONG, "sun moon star", "a dog"]
    requests = [GenerationRequest(p, a, max_new_tokens=6, top_k=3) for p, a in zip(prompts, names)]
    results = []
    for args in ({}, {"max_loras_per_batch": "1", "max_batch_size": "2"},
                 {"kv_block_size": "4", "num_kv_blocks": "12", "prefix_cache": "0"}):
        with BuiltinEngine(base, "cpu", "float32", args) as eng:
            for n, p in ads.items():
                eng.load_adapter(n, p)
            results.append(eng.generate(requests))
            if args:
                assert eng.llm.steps["prefill"] > 1  # the batch really was split
    for other in results[1:]:
        for x, y in zip(results[0], other):
            close(x, y)


def test_prefix_cache_hit_equals_miss_and_keys_on_identity(setup, tmp_path):
    base, ads, _ = setup
    twin = tmp_path / "twin"
    shutil.copytree(ads["a1"], twin)
    with BuiltinEngine(base, "cpu", "float32", {"kv_block_size": "4"}) as eng:
        eng.load_adapter("a1", ads["a1"])
        eng.load_adapter("twin", twin)
        eng.load_adapter("a2", ads["a2"])
        miss = eng.generate(reqs(["a1", None]))
        h0 = eng.blocks.hits
        hit = eng.generate(reqs(["a1", None]))
        assert eng.blocks.hits - h0 == 2 * ((len(hit[0].prompt_token_ids) - 1) // 4)
        for x, y in zip(miss, hit):
            close(x, y)
        h1 = eng.blocks.hits
        eng.generate(reqs(["twin"]))  # same weights, other name: same identity, shares blocks
        assert eng.blocks.hits > h1
        h2 = eng.blocks.hits
        eng.generate(reqs(["a2"]))  # different weights: never served a1's or base's KV
        assert eng.blocks.hits == h2
    with BuiltinEngine(base, "cpu", "float32", {"kv_block_size": "4", "prefix_cache": "0"}) as eng:
        eng.generate(reqs([None]))
        eng.generate(reqs([None]))
        assert eng.blocks.hits == 0


def test_deterministic_and_order_invariant(setup):
    base, ads, _ = setup
    names = ["a0", None, "a1", "a2", None, "a3"]
    prompts = [LONG, "red blue", "one two three four", "a dog ran", "sun moon", LONG[:20]]
    requests = [GenerationRequest(p, a, max_new_tokens=5, top_k=3, prompt_logprobs=True)
                for p, a in zip(prompts, names)]
    with BuiltinEngine(base, "cpu", "float32", {"prefix_cache": "0"}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        first = eng.generate(requests)
        again = eng.generate(requests)
        order = [3, 0, 5, 1, 4, 2]
        shuffled = eng.generate([requests[i] for i in order])
    assert [r.to_dict() for r in first] == [r.to_dict() for r in again]  # bitwise
    assert [first[i].to_dict() for i in order] == [r.to_dict() for r in shuffled]
