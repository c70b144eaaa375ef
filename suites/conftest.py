"""Conformance suites: run with `pytest suites --device=... --engine=...`.

This conftest activates the lora-conformance plugin (options, fixtures, report header) for runs of
the suites: installed, the plugin does nothing in other projects' pytest runs.

Suites that draw examples with hypothesis import ``given`` from ``lora_conformance.hypothesis_profile``,
which loads the suites' profile first.
"""

pytest_plugins = ["lora_conformance.plugin"]
