"""Hypothesis for the conformance suites: ``given`` and ``st``, with the suites' profile loaded.

Property-based compositions are bounded and derandomised, so a red run reproduces (in CI and for a
vendor re-running it) and its references stay cached. The search is bounded too: a few examples,
no example database (nothing read or written between runs) and no shrinking, so a failing engine
fails at its first failing example, which the test prints in full (``note``), instead of spending
minutes shrinking it (each shrink step runs the engine and its reference). The "explore" profile
draws new examples each run and shrinks them, for engine developers hunting bugs
(``LORA_CONFORMANCE_HYPOTHESIS_PROFILE=explore``; the per-test time budget still applies).

A suite imports ``given`` from here, so the profile is in place before ``@given`` reads it, and
hypothesis is imported only by a process that collects such a suite (pytest-xdist's controller,
which collects nothing, never imports it).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

PROFILE_VARIABLE = "LORA_CONFORMANCE_HYPOTHESIS_PROFILE"
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("lora-conformance", max_examples=6, derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate), print_blob=False, **_COMMON)
settings.register_profile("explore", max_examples=25, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get(PROFILE_VARIABLE, "lora-conformance"))

__all__ = ["given", "note", "st", "PROFILE_VARIABLE"]
