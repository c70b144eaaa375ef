"""Conformance suites: run with `pytest suites --device=... --engine=...` (fixtures come from the plugin).

Suites that draw examples with hypothesis import ``given`` from ``lora_conformance.suite_hypothesis``,
which loads the suites' profile first.
"""
