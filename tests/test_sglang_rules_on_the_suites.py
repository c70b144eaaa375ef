"""The lifecycle suite under SGLang's rules: the sglang plugin over the stand-in whose outputs
the built-in engine computes (tests/_sglang_standin.py, compute=True).

What SGLang's source says it does with the suite's requests, before any real run: pinning all
N adapter slots is accepted (its max_loras_per_batch counts the base, whose slot stays free),
so ``lifecycle/pinning_every_slot_is_refused`` fails; the rest of the lifecycle suite passes
through SGLang's bookkeeping (reload by unload-then-load, eviction past max_loaded_loras and
reload on use). A real SGLang run is still needed: the stand-in computes nothing of SGLang's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _sglang_standin as standin  # noqa: E402

from lora_conformance.settings import suites_dir  # noqa: E402


def test_lifecycle_suite_under_sglangs_rules(suite_runner, lora_settings, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", standin.module("0.5.23", compute=True))
    # No expectations: the bundled sglang-cpu file records what real SGLang 0.5.15.post1 computes (rsLoRA
    # ignored, ...); the stand-in's outputs are the built-in engine's, so only SGLang's rules show here.
    (tmp_path / "none.toml").write_text("")
    result = suite_runner.runpytest(str(suites_dir() / "test_lifecycle.py"), "--device=cpu", "--dtype=float32",
                                    "--engine=sglang", f"--lora-cache={lora_settings.cache_dir}",
                                    f"--expectations={tmp_path / 'none.toml'}",
                                    "-p", "no:cacheprovider", "-q", "-rfEs")
    reports = [r for r in result.reprec.getreports("pytest_runtest_logreport")]
    failed = sorted({r.nodeid.split("::")[-1].split("[")[0] for r in reports if r.failed})
    passed = sorted({r.nodeid.split("::")[-1].split("[")[0] for r in reports if r.when == "call" and r.passed})
    out = result.stdout.str()
    assert failed == ["test_pinning_every_slot_is_refused"], out[-4000:]
    assert "DID NOT RAISE" in out
    assert {"test_load_unload_reload", "test_unknown_adapter_gives_a_clear_error",
            "test_reloading_a_name_with_new_weights"} <= set(passed), (passed, out[-4000:])
    # Outputs stay right through SGLang's eviction, but SGLang does not report which adapters it
    # holds, so the lru policy itself is not certified (said, not silently passed).
    assert "policy itself is not certified" in out, out[-4000:]
