"""Conformance suites: run with `pytest suites --device=... --engine=...` (fixtures come from the plugin)."""

import os

from hypothesis import HealthCheck, settings

# Property-based compositions: bounded, and derandomised in CI so a red run reproduces.
settings.register_profile(
    "lora-conformance",
    max_examples=6,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("LORA_CONFORMANCE_HYPOTHESIS_PROFILE", "lora-conformance"))
