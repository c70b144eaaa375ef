"""The per-test time budget (--lora-test-timeout): an overrunning test fails with a clear message and
the run goes on; hypothesis does not shrink it; a phase that ends in time is never interrupted."""

from __future__ import annotations

import time

import pytest

from lora_conformance.time_budget import TimeBudgetExceeded, _Watch, parse_seconds


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_watch_interrupts_a_python_loop_once_the_budget_is_spent():
    watch = _Watch(0.2, "demo ran past its time budget of 0.2 s")
    start = time.monotonic()
    with pytest.raises(TimeBudgetExceeded, match="demo ran past its time budget of 0.2 s"):
        _spin(30)
    assert time.monotonic() - start < 10
    assert watch.end() is True


def test_a_phase_that_ends_in_time_is_never_interrupted():
    watch = _Watch(0.2, "never")
    assert watch.end() is False
    _spin(0.5)  # past the budget: the cancelled watch raises nothing
    watch.timer.join(5)
    assert not watch.fired and not watch.timer.is_alive()


@pytest.mark.parametrize("value, ok", [("600", 600.0), ("0", 0.0), ("1.5", 1.5), ("-1", None), ("soon", None),
                                       ("nan", None)])
def test_parse_seconds(value, ok):
    if ok is None:
        with pytest.raises(ValueError, match="seconds"):
            parse_seconds(value)
    else:
        assert parse_seconds(value) == ok


def test_an_overrunning_test_fails_with_a_message_and_the_run_goes_on(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    pytester.makepyfile(test_budget="""
import time
from hypothesis import given, settings, strategies as st

calls = []

def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

def test_slow():
    _spin(60)

@settings(max_examples=1000, deadline=None, database=None)
@given(st.integers())
def test_slow_property(x):
    calls.append(x)
    _spin(0.2)

def test_after():
    print("CALLS", len(calls))
""")
    start = time.monotonic()
    result = pytester.runpytest("--device=cpu", "--lora-test-timeout=1", "-p", "no:cacheprovider", "-s")
    assert time.monotonic() - start < 45
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines([
        "*TimeBudgetExceeded: test_budget.py::test_slow: call ran past its time budget of 1 s "
        "(--lora-test-timeout, from command line)*"])
    assert "Falsifying example" not in result.stdout.str()  # not a failing example to shrink
    calls = int(next(l for l in result.outlines if "CALLS " in l).split("CALLS ")[1])
    assert calls < 20  # stopped inside the budget, not after hypothesis's 1000 examples


def test_the_budget_reads_the_environment_and_zero_turns_it_off(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_TEST_TIMEOUT", "0")
    pytester.makepyfile(test_x="""
import time

def test_a_while(request):
    assert request.config.pluginmanager.get_plugin("lora-conformance-time-budget") is None
    time.sleep(0.3)
""")
    pytester.runpytest("--device=cpu", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_TEST_TIMEOUT", "soon")
    result = pytester.runpytest("--device=cpu", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--lora-test-timeout='soon' (from environment LORA_CONFORMANCE_LORA_TEST_TIMEOUT)*seconds*"])
