"""Loading is transactional on the engines we ship in-process (builtin, peft): a refused adapter
leaves the same adapter list and bit-identical outputs for the base and every loaded adapter,
and the refusal is a typed EngineError naming the adapter's file. Also the loading failures
these engines once had, each reproduced (some with the shared validator bypassed, to show the
engine's own rollback holds where a file gets past validation)."""

from __future__ import annotations

import json
import math

import pytest

from lora_conformance.adapters import AdapterSpec, synthesize_adapter
from lora_conformance.adapters.malformed import BAD_NAMES, MALFORMED, make_malformed
from lora_conformance.judge.health import assert_healthy, probe_requests, snapshot
from lora_conformance.engines import create_engine
from lora_conformance.engines.base import AdapterIncompatibleError, EngineError, EngineFailure

ENGINES = ("builtin", "peft")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("txn")
    return {
        "A": synthesize_adapter(llama, AdapterSpec(seed=9), root / "A"),
        "B": synthesize_adapter(llama, AdapterSpec(seed=19, rank=16), root / "B"),
        "neg": synthesize_adapter(llama, AdapterSpec(seed=5, alpha=-16), root / "neg"),
    }


@pytest.fixture(scope="module", params=ENGINES)
def loaded(request, llama, adapters):
    engine = create_engine(request.param, llama, "cpu", "float32", {})
    engine.load_adapter("A", adapters["A"])
    engine.load_adapter("B", adapters["B"])
    yield engine, snapshot(engine)
    engine.close()


def _refused(engine, name, path):
    with pytest.raises(EngineError) as exc:
        engine.load_adapter(name, path)
    assert not isinstance(exc.value, EngineFailure), f"a refusal, not a crash: {exc.value!r}"
    return exc.value


# Every kind as a new name; a few over a loaded name (the suite covers the rest on every engine).
CASES = [(k, "C") for k in sorted(MALFORMED)] + [(k, "A") for k in ("truncated_weights", "nan_value",
                                                                     "config_rank_mismatch")]


@pytest.mark.parametrize("kind,as_name", CASES)
def test_malformed_adapter_is_refused_and_changes_nothing(loaded, adapters, tmp_path, kind, as_name):
    engine, before = loaded
    bad = make_malformed(kind, adapters["A"], tmp_path / kind, engine.limits.max_rank)
    err = _refused(engine, as_name, bad)
    assert isinstance(err, AdapterIncompatibleError) and str(bad) in str(err), f"error should name {bad}: {err}"
    assert_healthy(engine, before, f"refusing {kind} as {as_name}")


def test_bad_adapter_names_are_refused(loaded, adapters):
    engine, before = loaded
    for name in BAD_NAMES:
        _refused(engine, name, adapters["A"])
    assert_healthy(engine, before, f"refusing the names {BAD_NAMES}")


# ---- builtin: an unloaded slot is zeroed ----------------------------------------------


def test_builtin_unload_clears_the_slot(llama, adapters, tmp_path):
    """Unload zeroes the slot's weights: the masked decode reads every slot, so weights left in a
    freed slot (NaN ones included, had any got past the validator and the pack check) would reach
    base rows. With the only adapter unloaded, every slot holds zeros and base rows are unchanged."""
    engine = create_engine("builtin", llama, "cpu", "float32", {})
    base_reqs = probe_requests([None])
    clean = engine.generate(base_reqs)
    engine.load_adapter("A", adapters["A"])
    engine.generate(probe_requests(["A", None]))  # puts A's weights in a slot
    pools = [t for _, m in engine.runner.lora_modules.items() for t in (engine.runner._pool_of(m[1]) or ())]
    assert pools and any(bool(t.abs().sum() > 0) for t in pools), "A's weights never reached a slot"
    engine.unload_adapter("A")
    after = engine.generate(base_reqs)
    for a, b in zip(clean, after):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, (
            f"base output after unloading: expected {a.logprobs}, got {b.logprobs}")
    assert all(not bool(t.abs().sum() > 0) for t in pools), "a freed slot still holds the adapter's weights"


def test_nan_adapter_is_refused_naming_tensor(llama, adapters, tmp_path):
    engine = create_engine("builtin", llama, "cpu", "float32", {})
    bad = make_malformed("nan_value", adapters["A"], tmp_path / "n", 64)
    err = _refused(engine, "N", bad)
    assert "lora_B" in str(err) and "non-finite" in str(err) and "adapter_model.safetensors" in str(err), str(err)
    assert engine.list_adapters() == []


# ---- peft: failed loads and reloads leave nothing behind (validator bypassed) -----------


@pytest.fixture
def no_validation(monkeypatch):
    from lora_conformance.adapters import validate

    monkeypatch.setattr(validate, "validate_adapter", lambda *a, **k: None)


def _same(a_list, b_list, what):
    for a, b in zip(a_list, b_list):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, f"{what}: expected {a.logprobs}, got {b.logprobs}"


def test_peft_failed_first_load_leaves_the_base_model(llama, adapters, tmp_path, no_validation):
    engine = create_engine("peft", llama, "cpu", "float32", {})
    before = engine.generate(probe_requests([None]))
    err = _refused(engine, "T", make_malformed("truncated_weights", adapters["A"], tmp_path / "t", 64))
    assert isinstance(err, AdapterIncompatibleError), repr(err)
    _same(before, engine.generate(probe_requests([None])), "base after a failed first load")
    assert engine.list_adapters() == []


def test_peft_failed_load_leaves_no_config_behind(llama, adapters, tmp_path, no_validation):
    """A failed load of X must not leave X's config for the next load of X (alpha +16 vs -16)."""
    engine = create_engine("peft", llama, "cpu", "float32", {})
    engine.load_adapter("A", adapters["A"])
    bad = make_malformed("truncated_weights", adapters["A"], tmp_path / "t", 64)  # alpha +16, unreadable
    _refused(engine, "X", bad)
    engine.load_adapter("X", adapters["neg"])  # alpha -16
    fresh = create_engine("peft", llama, "cpu", "float32", {})
    fresh.load_adapter("X", adapters["neg"])
    _same(fresh.generate(probe_requests(["X"])), engine.generate(probe_requests(["X"])), "X after a failed load")


def test_peft_failed_reload_keeps_the_old_adapter(llama, adapters, tmp_path, no_validation):
    engine = create_engine("peft", llama, "cpu", "float32", {})
    engine.load_adapter("X", adapters["A"])
    before = engine.generate(probe_requests([None, "X"]))
    _refused(engine, "X", make_malformed("truncated_weights", adapters["B"], tmp_path / "t", 64))
    assert engine.list_adapters() == ["X"]
    _same(before, engine.generate(probe_requests([None, "X"])), "after a failed reload")


def test_peft_refuses_non_finite_weights(llama, adapters, tmp_path):
    engine = create_engine("peft", llama, "cpu", "float32", {})
    err = _refused(engine, "N", make_malformed("inf_value", adapters["A"], tmp_path / "n", 64))
    assert "non-finite" in str(err)
    out = engine.generate(probe_requests([None]))
    assert all(math.isfinite(v) for r in out for step in r.logprobs for v in step.values())


def test_config_rank_mismatch_is_refused_by_builtin(llama, adapters, tmp_path):
    """Before: the builtin engine scaled by the config's r when the tensors carried another rank."""
    engine = create_engine("builtin", llama, "cpu", "float32", {})
    bad = make_malformed("config_rank_mismatch", adapters["A"], tmp_path / "m", 64)
    err = _refused(engine, "M", bad)
    assert json.loads((bad / "adapter_config.json").read_text())["r"] == 16 and "rank 8" in str(err), str(err)
