"""Fixtures for the project's own tests."""

import pytest


@pytest.fixture
def suite_runner(pytester):
    """pytester, with the heavy libraries imported in this process first.

    An in-process pytester run restores ``sys.modules`` afterwards; a lazily imported
    transformers submodule dropped that way breaks the next run ("Could not import module
    'AutoTokenizer'"). Importing them before the first run keeps them in the snapshot.
    """
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import lora_conformance.engines.builtin  # noqa: F401
    import lora_conformance.engines.peft_engine  # noqa: F401
    import lora_conformance.harness  # noqa: F401
    import lora_conformance.reference  # noqa: F401

    return pytester
