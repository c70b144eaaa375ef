"""Repository-level pytest configuration.

Installed, the plugin does nothing in a pytest run that does not ask for it (see
lora_conformance/autoload.py); this repository's own tests use its fixtures and options, so this
file loads it. It also keeps ``pytest`` run from the repository root away from folders that hold
scripts rather than tests, and from the suites, which run by name (``pytest suites --device=...``:
their conftest.py, which loads the plugin for them, must be an initial conftest).
"""

pytest_plugins = ["lora_conformance.plugin"]

collect_ignore = ["bench", "ci", "fixtures", "reports", "suites"]
