"""The pytest11 entry point: pytest loads it into every run of the environment, so it does nothing
there. The lora-conformance plugin (``lora_conformance.plugin``: the ``--device``, ``--engine``, ...
options, the ``device``/``dtype`` parametrisation, the fixtures, the report header) is loaded only
where a run asks for it:

- ``pytest suites ...`` in a checkout, or a path into the installed suites: their ``conftest.py``;
- ``pytest -p lora_conformance.plugin ...`` (what ``lora-conformance certify`` passes);
- ``pytest --pyargs lora_conformance.suites ...``: this module, seeing that argument.

So another project's ``--device`` option, ``device`` fixture, header and cache are left alone.
"""

from __future__ import annotations

import pytest

PLUGIN = "lora_conformance.plugin"
SUITES_PACKAGE = "lora_conformance.suites"


def names_our_suites(args: list[str], pyargs: bool) -> bool:
    """Whether ``--pyargs`` arguments name the bundled suites (the package, a module, or a test in it)."""
    if not pyargs:
        return False
    for arg in args:
        name = str(arg).split("::", 1)[0]
        if name == SUITES_PACKAGE or name.startswith(SUITES_PACKAGE + "."):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    # The suites' conftest.py activates the plugin for a path argument, before the command line is
    # parsed (an initial conftest). A --pyargs module name has no initial conftest: activate it here,
    # still in time for its options to be parsed.
    ns = early_config.known_args_namespace
    if names_our_suites(list(getattr(ns, "file_or_dir", None) or ()), bool(getattr(ns, "pyargs", False))):
        early_config.pluginmanager.import_plugin(PLUGIN)
