"""Garbage-collector tuning for the process's own pytest run (a plugin the lora-conformance plugin
registers; it never runs in a pytest run that did not ask for lora-conformance).

What collection imported (torch, transformers, the suites) lives for the whole run: frozen, the
cyclic collector's passes during the run only walk what tests create (about 1 s of a
certification run), and the passes pytest and the interpreter make at the end skip it.
"""

from __future__ import annotations

import sys

import pytest

_FROZEN_KEY = pytest.StashKey[bool]()
_EXIT_HANDLER_REGISTERED = False
# pytest runs configured in this process and not yet unconfigured: 1 for the process's own run, 2
# and more while a test runs pytest inline (pytester). Only the process's own run freezes objects:
# an inline run's session becomes garbage when it ends, and frozen garbage is never collected.
_OPEN_CONFIGS = 0


def _nanobind_loaded() -> bool:
    """Whether an extension module built with nanobind (triton's, among others) is loaded: nanobind
    counts its objects at interpreter exit and prints a leak report for every one never freed."""
    import importlib.machinery

    for mod in list(sys.modules.values()):
        if not isinstance(getattr(mod, "__loader__", None), importlib.machinery.ExtensionFileLoader):
            continue
        if any(type(v).__name__ == "nb_func" for v in list(vars(mod).values())):
            return True
    return False


def _gc_at_exit() -> None:
    """The interpreter's final collection walks every object still alive (about 0.7 s a process with
    torch and transformers loaded, paid by each worker before pytest-xdist's controller can finish).
    Freeze them, so it skips them; but where nanobind is loaded, hand everything back to the
    collector, so that its objects are freed and it reports no leaks."""
    import gc

    if _nanobind_loaded():
        gc.unfreeze()
    else:
        gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    global _OPEN_CONFIGS
    _OPEN_CONFIGS += 1


def pytest_collection_finish(session: pytest.Session) -> None:
    if _OPEN_CONFIGS != 1:
        return  # a run inside a test (see _OPEN_CONFIGS)
    import atexit
    import gc

    gc.freeze()
    session.config.stash[_FROZEN_KEY] = True
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:  # once per process (pytester runs many sessions in one)
        atexit.register(_gc_at_exit)
        _EXIT_HANDLER_REGISTERED = True


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # pytest's closing check for unraisable exceptions runs five full collections after this hook:
    # about 0.7 s a process once the tests have imported transformers and built engines. Collect
    # the run's garbage once here (its finalizers run, so their exceptions still surface), then
    # freeze what survives: those five passes, and the interpreter's at exit, only walk the rest.
    global _OPEN_CONFIGS
    _OPEN_CONFIGS = max(0, _OPEN_CONFIGS - 1)
    if config.stash.get(_FROZEN_KEY, False):
        import gc

        gc.collect()
        gc.freeze()
