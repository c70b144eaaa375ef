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


# ---- how pytest-xdist spreads these tests (the README's `python -m pytest -n auto`) ----------
#
# Files are the unit (--dist loadfile, unless the command line names a --dist): a file's module
# fixtures (engines, checkpoints, oracles) are built once, on one worker, and files go to the
# workers longest first, each worker taking the next file as it runs out (run_order's file order).
# Under xdist's default --dist load the first quarter of the collection goes to the first worker
# in one chunk: with the tests ordered longest first, that worker got 1,900 of 2,080 test-seconds.
# The file times come from the last run on this machine (run_order's durations); a file it has no
# time for takes its time from tests/durations.json (measured, checked in), so a fresh clone with
# an empty cache starts the long files first too. docs/performance.md, "The project's own test run".

@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # Before xdist's own (also tryfirst; a conftest's runs first): -n without --dist means "load" there.
    if config.getoption("numprocesses", None) and config.getoption("dist", None) == "no" \
            and not config.getoption("distload", False):
        config.option.dist = "loadfile"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # After the plugin's ordering (by the last run alone): the same file order, with the measured
    # times of tests/durations.json for the files the last run did not time. Identical on every worker.
    from _file_order import item_durations, seed_durations
    from lora_conformance import run_order

    if run_order.worker_dist(config) != "loadfile":
        return
    durations = item_durations(items, run_order.worker_durations(config) or {}, seed_durations())
    if durations:
        items[:] = run_order.order(items, durations, by_file=True, groups=run_order.worker_groups(config),
                                   last=run_order.worker_last(config))


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


# What a cache directory holds that is content-addressed (harness.py): models, adapters, reference
# outputs, module shapes and tokenizer resolutions. The durations, engine uses and deaths that
# run_order keeps (durations/) are a run's own.
SHARED_CACHE_PARTS = ("models", "adapters", "references", "shapes", "tokenizers")


@pytest.fixture
def cache_with_own_durations(tmp_path, lora_settings):
    """A cache directory for a pytest run a test starts: its own durations/ (what run_order's tests
    check starts empty), everything else linked to the session's cache, so the run does not build
    the synthetic model and adapters again (about 10 s each time on 2 cores)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for part in SHARED_CACHE_PARTS:
        shared = lora_settings.cache_dir / part
        shared.mkdir(parents=True, exist_ok=True)
        (cache / part).symlink_to(shared, target_is_directory=True)
    return cache
