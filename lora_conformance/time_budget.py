"""A time budget per test phase: ``--lora-test-timeout SECONDS`` (0: none), for setup, call and
teardown each (a plugin the lora-conformance plugin registers).

A hung or very slow engine must cost one failed test with a clear message, not the run. A
watchdog thread waits out the budget; when it runs out, it prints which test overran and raises
``TimeBudgetExceeded`` in the thread running the test, through CPython's asynchronous exception
(``PyThreadState_SetAsyncExc``). Why this way:

- the run goes on, and the failure is recorded like any other (report, root causes): killing the
  process, as pytest-timeout's thread method does, loses the report;
- it needs no signal (pytest-timeout's signal method takes SIGALRM, POSIX and main thread only);
- ``TimeBudgetExceeded`` derives from ``BaseException``: hypothesis does not take it for a
  failing example to shrink, and an engine's ``except Exception`` does not swallow it.

The exception is raised at the next Python bytecode, so a thread blocked inside one long native
call (a kernel, a socket read) fails when that call returns; the printed line says so at once.
After a phase that ran out, ``on_timeout(item)`` runs (the plugin discards the engines, whose state
the interruption may have left half-updated).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Callable, Optional

import pytest


class TimeBudgetExceeded(BaseException):
    """A test phase ran past ``--lora-test-timeout``."""

    message = "test ran past its time budget"

    def __str__(self) -> str:
        return self.message


def parse_seconds(value: object) -> float:
    """The budget in seconds: a non-negative number; 0 turns it off."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds (0: no budget)") from None
    if seconds < 0 or seconds != seconds:
        raise ValueError("expected a number of seconds >= 0 (0: no budget)")
    return seconds


def _raise_in(thread_id: int, exc_type: Optional[type]) -> None:
    """Raise ``exc_type`` in the thread at its next bytecode (None: withdraw a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(0))


class _Watch:
    """One phase of one test: fires once, and never after the phase has ended."""

    def __init__(self, seconds: float, message: str) -> None:
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.ended = False
        self.fired = False
        self.message = message
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.ended:
                return
            self.fired = True
            print(f"\nlora-conformance: {self.message} (failing it at its next Python step)", file=sys.__stderr__,
                  flush=True)
            _raise_in(self.thread_id, type("TimeBudgetExceeded", (TimeBudgetExceeded,), {"message": self.message}))

    def end(self) -> bool:
        """Stop watching; whether the budget ran out."""
        self.timer.cancel()
        with self.lock:
            self.ended = True
            fired = self.fired
        if fired:
            _raise_in(self.thread_id, None)  # not raised yet (the phase ended first): withdrawn
        return fired


class TimeBudget:
    """The plugin object: registered by the lora-conformance plugin when the budget is not 0."""

    def __init__(self, seconds: float, source: str, on_timeout: Callable[[pytest.Item], None] = lambda item: None):
        self.seconds = seconds
        self.source = source
        self.on_timeout = on_timeout

    def _watch(self, item: pytest.Item, when: str):
        watch = _Watch(self.seconds, f"{item.nodeid}: {when} ran past its time budget of {self.seconds:g} s "
                                     f"(--lora-test-timeout, from {self.source})")
        try:
            return (yield)
        finally:
            if watch.end():
                self.on_timeout(item)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        return (yield from self._watch(item, "setup"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item):
        return (yield from self._watch(item, "call"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: Optional[pytest.Item]):
        return (yield from self._watch(item, "teardown"))
