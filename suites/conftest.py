"""Conformance suites: run with `pytest suites --device=... --engine=...` (fixtures come from the plugin)."""

import os

from hypothesis import HealthCheck, settings

# Property-based compositions: bounded and derandomised, so a red run reproduces (in CI and for
# a vendor re-running it) and its references stay cached. The "explore" profile draws new
# examples each run, for engine developers hunting bugs.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("lora-conformance", max_examples=6, derandomize=True, **_COMMON)
settings.register_profile("explore", max_examples=25, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("LORA_CONFORMANCE_HYPOTHESIS_PROFILE", "lora-conformance"))
