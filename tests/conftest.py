"""Fixtures for the project's own tests.

The heavy libraries are imported here, at collection, on purpose: an in-process pytester
run restores ``sys.modules`` afterwards, and a lazily imported transformers submodule
dropped that way breaks the next run ("Could not import module 'AutoModel'"). Modules
imported before the first run stay in the snapshot.

The plugin does nothing in a run that does not ask for it: the repository's conftest.py loads it
for these tests, and ``PYTEST_PLUGINS`` loads it into the pytest runs they start (pytester, in
process or in a child); a test of the plugin's absence removes that variable.
"""

import os

import peft  # noqa: F401
import pytest
import transformers  # noqa: F401
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import lora_conformance.engines.builtin  # noqa: F401
import lora_conformance.engines.builtin.engine.llm_engine  # noqa: F401  (the builtin class imports its parts,
import lora_conformance.engines.builtin.engine.model_runner  # noqa: F401  and the kernels' torch library,
import lora_conformance.engines.builtin.engine.inflight  # noqa: F401  only when an engine is created)
import lora_conformance.engines.builtin.layers.kernels  # noqa: F401
import lora_conformance.engines.builtin.models.loader  # noqa: F401
import lora_conformance.engines.peft_engine  # noqa: F401
import lora_conformance.harness  # noqa: F401
import lora_conformance.reference  # noqa: F401

os.environ["PYTEST_PLUGINS"] = ",".join(
    p for p in (*os.environ.get("PYTEST_PLUGINS", "").split(","), "lora_conformance.plugin") if p)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A fresh model/adapter cache for tests that check building and caching themselves."""
    return tmp_path_factory.mktemp("lc-cache")


@pytest.fixture(scope="session")
def llama(cache):
    from lora_conformance.models import resolve_base_model

    return resolve_base_model("synthetic:llama", cache)


@pytest.fixture(scope="session")
def tokenizer(llama):
    return AutoTokenizer.from_pretrained(str(llama))


@pytest.fixture
def suite_runner(pytester):
    """pytester for running the conformance suites in this process (see the module doc)."""
    return pytester
