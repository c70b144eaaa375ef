"""Bad input: malformed adapters and names are refused with a typed error, and the engine stays
exactly as it was (same adapter list, bit-identical outputs for the base and every loaded adapter).

The malformed adapters are made from a valid one by ``lora_conformance.adapters.malformed``
(one broken thing each); the health check is ``lora_conformance.judge.health``.
"""

import pytest

from lora_conformance.adapters.malformed import BAD_NAMES, MALFORMED, make_malformed
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_xpu_ci
from lora_conformance.judge.health import assert_healthy, snapshot
from lora_conformance.engines import EngineError, EngineFailure

register_cpu_ci(est_time=20, suite="per-commit")
register_cuda_ci(est_time=15, suite="per-commit")
register_xpu_ci(est_time=25, suite="per-commit")

pytestmark = [pytest.mark.base_model("decoder"), pytest.mark.requires("dynamic_loading")]

RELOAD_KINDS = ("truncated_weights", "nan_value", "shapes_of_another_model", "config_rank_mismatch")


def _healthy_engine(lora):
    """The shared engine with adapters A and B loaded, and its snapshot."""
    engine = lora.engine
    lora.load(engine, "A")
    lora.load(engine, "B")
    return engine, snapshot(engine, prompts=lora.prompts[:2])


def _assert_refused(engine, name, path, what, names_path=True):
    try:
        engine.load_adapter(name, path)
    except EngineFailure as exc:
        raise AssertionError(f"{what}: the engine broke instead of refusing ({type(exc).__name__}: {exc})") from exc
    except EngineError as exc:
        if names_path and str(path) not in str(exc):
            raise AssertionError(f"{what}: the error does not name the adapter ({path}): {exc}") from exc
        return exc
    if name not in ("A", "B"):  # take an accepted bad adapter out again, so later tests start clean
        engine.unload_adapter(name)
    raise AssertionError(f"{what}: accepted; expected a typed refusal (an EngineError subclass)")


@pytest.mark.feature("bad_input/malformed_adapter_is_refused",
                      "a malformed adapter is refused with a typed error naming it; the engine is unchanged")
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_adapter_is_refused(lora, device, dtype, tmp_path, kind):
    engine, before = _healthy_engine(lora)
    good = lora.adapter_path("C")
    bad = make_malformed(kind, good, tmp_path / kind, engine.limits.max_rank)
    _assert_refused(engine, "C", bad, f"loading {kind} as a new name")
    assert_healthy(engine, before, f"refusing {kind}")


@pytest.mark.feature("bad_input/failed_reload_keeps_the_loaded_adapter",
                      "a malformed adapter loaded over a loaded name is refused and the old adapter still serves")
@pytest.mark.parametrize("kind", RELOAD_KINDS)
def test_failed_reload_keeps_the_loaded_adapter(lora, device, dtype, tmp_path, kind):
    engine, before = _healthy_engine(lora)
    bad = make_malformed(kind, lora.adapter_path("C"), tmp_path / kind, engine.limits.max_rank)
    _assert_refused(engine, "A", bad, f"loading {kind} over adapter A")
    assert_healthy(engine, before, f"refusing {kind} over A")


@pytest.mark.feature("bad_input/bad_adapter_names_are_refused",
                      "adapter names with path or route separators, whitespace or PEFT's __base__ are refused")
def test_bad_adapter_names_are_refused(lora, device, dtype):
    engine, before = _healthy_engine(lora)
    good = lora.adapter_path("C")
    for name in BAD_NAMES:
        _assert_refused(engine, name, good, f"the adapter name {name!r}", names_path=False)
    assert_healthy(engine, before, f"refusing the names {BAD_NAMES}")


@pytest.mark.feature("bad_input/unload_leaves_no_trace",
                      "after an adapter is unloaded, the base and the other adapters give their earlier outputs")
def test_unload_leaves_no_trace(lora, device, dtype):
    engine, before = _healthy_engine(lora)
    lora.load(engine, "C")
    engine.generate(lora.requests(["C", None, "A", "C", "B"], prompts=lora.prompts[:2], max_new_tokens=4))
    engine.unload_adapter("C")
    assert_healthy(engine, before, "loading, serving and unloading C")
