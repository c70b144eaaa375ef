"""bench/power.py's judging: each family by the checks the suites apply to its adapters, the others
measured and shown apart (never a false alarm, never a detection)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("power_bench",
                                               Path(__file__).resolve().parents[1] / "bench" / "power.py")
power = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(power)


def test_every_family_has_its_applied_checks():
    assert set(power.APPLIED) == set(power.FAMILIES)
    for family, checks in power.APPLIED.items():
        assert set(checks) <= set(power.CHECKS), family
        assert {"effects", "free_running"} <= set(checks), f"{family}: lora.assert_conforms judges every family"


def test_strong_all_linear_adapters_are_not_judged_at_default_decode_bounds():
    """adapter_semantics::target_set[all-linear] and layers_to_transform: lora.assert_conforms only."""
    assert power.APPLIED["alllinear"] == ("effects", "free_running")


@pytest.mark.parametrize("family, failing, counted, apart", [
    ("alllinear", ["decode_default"], [], ["decode_default"]),
    ("alllinear", ["effects", "decode_default", "prompt"], ["effects"], ["prompt", "decode_default"]),
    ("accuracy", ["decode_default", "prompt_pooled"], ["prompt_pooled", "decode_default"], []),
    ("mixed", ["routing", "prompt"], ["routing"], ["prompt"]),
])
def test_judged_splits_applied_from_not_applied(family, failing, counted, apart):
    failures = {c: (["x"] if c in failing else []) for c in power.CHECKS}
    assert power.judged(family, failures) == (counted, apart)


def test_an_older_file_is_judged_as_now():
    """Rows written before APPLIED counted every check: merged, a decode_default alarm moves apart."""
    old = {"runs": 2, "false_alarms": 2, "by_check": {c: 0 for c in power.CHECKS} | {"decode_default": 2},
           "defects": 0, "worst": {}, "variations": {}}
    alarms = [{"family": "alllinear", "variation": "default", "defects": [],
               "failures": {c: (["step 3"] if c == "decode_default" else []) for c in power.CHECKS}}] * 2
    row = power._judged_row("alllinear", old, alarms)
    assert row["false_alarms"] == 0 and row["not_applied"] == {"decode_default": 2} and row["by_check"] == {}


def test_power_cells_name_the_check_that_caught_it():
    cell = [3, 3, {c: 0 for c in power.CHECKS} | {"effects": 3, "decode_default": 3}]
    text = power._caught_by("alllinear", cell)
    assert text == "caught by: effects 3, free_running 0; not applied: decode_default 3"
    assert "not recorded" in power._caught_by("alllinear", [1, 1])
