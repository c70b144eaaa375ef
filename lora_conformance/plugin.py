"""The lora-conformance pytest plugin: options, markers, collection rules, fixtures.

Loaded only where a run asks for it, never into every pytest run of the environment (the pytest11
entry point, ``lora_conformance.autoload``, leaves other projects' runs alone): by the suites' own
``conftest.py`` (``pytest suites ...``), by ``-p lora_conformance.plugin`` (what ``lora-conformance
certify`` passes; any project's tests can use it too), or by ``--pyargs lora_conformance.suites``.

Thin by design: importing this module imports pytest and our option tables only. torch,
transformers, PEFT and engines load inside hooks and fixtures, and only when a run needs
them, so ``pytest --help`` stays fast and touches no accelerator.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


import pytest

from lora_conformance import options, parallel
from lora_conformance.devices import SHORTHAND_TYPES
from lora_conformance.features import MARKER_HELP as FEATURE_MARKER_HELP
from lora_conformance.settings import SETTINGS_KEY, Settings, default_cache_dir, get_settings
from lora_conformance.time_budget import parse_seconds

MARKERS = (
    f"device(*types): run only on these device types ({', '.join(SHORTHAND_TYPES)}, or a vendor type)",
    *(f"{t}: shorthand for device({t!r})" for t in SHORTHAND_TYPES),
    FEATURE_MARKER_HELP,
    "requires(*capabilities): engine capabilities the test needs; without them it is skipped as not certified",
    "base_model(kind): the base model a suite needs (decoder, moe, encoder) when it differs from --base-model",
    "slow: heavier parametrisations, deselect with -m 'not slow'",
)
HARNESS_KEY = pytest.StashKey["Any"]()


# ---- options and settings --------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def _worker_index() -> int | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def _check_engine(name: str) -> str:
    from lora_conformance.engines.registry import available_engines

    if name not in available_engines() and ":" not in name:
        raise ValueError(f"expected one of {', '.join(sorted(available_engines()))}, or module:Class")
    return name


def _check_base_model(spec: str) -> str:
    from lora_conformance.models import SYNTHETIC_KINDS as kinds  # stdlib-only module: no torch here
    if spec.startswith("synthetic:"):
        if spec.split(":", 1)[1] not in kinds:
            raise ValueError(f"expected synthetic:{', synthetic:'.join(kinds)}, or a local HF checkpoint directory")
    elif not (Path(spec) / "config.json").is_file():
        raise ValueError("not a synthetic:* model and no config.json in that directory "
                         f"(expected synthetic:{', synthetic:'.join(kinds)}, or a local HF checkpoint directory)")
    return spec


def _check_engine_config(settings: Settings) -> None:
    """Before any test and any engine: the engine's optional dependency is installed and its args
    parse (engines/args.py); a usage error of one line otherwise, so no report is written."""
    from lora_conformance.engines.args import check_engine_config
    from lora_conformance.engines.base import EngineError

    try:
        check_engine_config(settings.engine, settings.engine_args, settings.sources.get("engine_arg", "command line"))
    except EngineError as exc:
        raise options.OptionError(str(exc)) from None


def resolve_settings(config: pytest.Config) -> Settings:
    from lora_conformance import devices

    def check_device(spec: str) -> str:
        try:
            return devices.resolve_device(spec, _worker_index())
        except devices.DeviceError as exc:
            raise ValueError(f"{exc}; accepted: cpu, cuda[:N], xpu[:N], a registered torch device type, auto") from None

    r = options.resolve(config, validators={
        "engine_arg": options.parse_engine_args,
        "engine": _check_engine,
        "base_model": _check_base_model,
        "lora_threads": parallel.parse_threads,
        "lora_test_timeout": parse_seconds,
    })
    try:
        device = check_device(r["device"])
    except ValueError as exc:
        raise options.OptionError(f"--device={r['device']!r} (from {r.source('device')}): {exc}") from None
    cache = Path(r["lora_cache"]).expanduser() if r["lora_cache"] else default_cache_dir()
    return Settings(
        device=device,
        device_spec=r["device"],
        engine=r["engine"],
        engine_args=r["engine_arg"] or {},
        base_model=r["base_model"],
        dtype=r["dtype"] or devices.default_dtype_for(device),
        reference_device=r["reference_device"],
        reference_dtype=r["reference_dtype"],
        cache_dir=cache,
        refresh_references=bool(r["lora_refresh_references"]),
        report_dir=Path(r["lora_report"]) if r["lora_report"] else None,
        expectations=Path(r["expectations"]) if r["expectations"] else None,
        ci_hw=r["ci_hw"],
        ci_suite=r["ci_suite"],
        ci_nightly=bool(r["ci_nightly"]),
        ci_partition=r["ci_partition"],
        ci_durations=Path(r["ci_durations"]) if r["ci_durations"] else None,
        test_timeout=r["lora_test_timeout"],
        sources=dict(r.sources),
        threads=parallel.thread_share(parallel.cpu_cores(), parallel.xdist_workers(config), r["lora_threads"],
                                      r.source("lora_threads")),
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if config.getoption("help", False) or config.getoption("version", False):
        return
    settings = resolve_settings(config)
    _check_engine_config(settings)
    config.stash[SETTINGS_KEY] = settings
    from lora_conformance import gc_tuning

    config.pluginmanager.register(gc_tuning, "lora-conformance-gc")
    if not hasattr(config, "workerinput"):
        _check_writable_dirs(settings)
    _register_subplugins(config, settings)
    from lora_conformance import run_order

    run_order.configure(config, run_order.durations_path(settings.cache_dir, settings.engine, settings.device_type,
                                                         settings.dtype))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    # pytest-xdist controller: every worker orders its collection by the same durations.
    from lora_conformance import run_order

    if SETTINGS_KEY in node.config.stash:
        node.workerinput[run_order.WORKERINPUT_KEY] = run_order.node_input(node.config)


def _check_writable_dirs(settings: Settings) -> None:
    """A read-only (or full) cache or report directory stops the run before any work, as a usage
    error naming the directory, instead of failing tests as if the engine were at fault or losing
    the report at the end."""
    from lora_conformance.fileio import CacheEnvironmentError, check_writable_dir

    try:
        check_writable_dir(settings.cache_dir, "the lora-conformance cache (--lora-cache)")
        if settings.report_dir is not None:
            check_writable_dir(settings.report_dir, "the report directory (--lora-report)",
                               "the report is written there at the end: give a writable --lora-report")
    except CacheEnvironmentError as exc:
        raise pytest.UsageError(str(exc)) from None


def _register_subplugins(config: pytest.Config, settings: Settings) -> None:
    from lora_conformance.expectations import ExpectationsPlugin, default_expectations_path

    if settings.test_timeout:
        from lora_conformance.time_budget import TimeBudget

        config.pluginmanager.register(TimeBudget(settings.test_timeout, settings.sources.get("lora_test_timeout", "default"),
                                                 on_timeout=lambda item: _discard_engines(item.config)),
                                      "lora-conformance-time-budget")

    path = settings.expectations or default_expectations_path(settings.engine, settings.device_type)
    if path is not None:
        config.pluginmanager.register(ExpectationsPlugin(path), "lora-conformance-expectations")
    if settings.ci_hw or settings.ci_suite or settings.ci_partition:
        from lora_conformance.ci.pytest_ci import CISelection

        config.pluginmanager.register(CISelection(settings), "lora-conformance-ci")
    if settings.report_dir is not None and not hasattr(config, "workerinput"):
        from lora_conformance.report.recorder import ReportRecorder

        config.pluginmanager.register(ReportRecorder(settings, settings.report_dir), "lora-conformance-report")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if SETTINGS_KEY not in config.stash:
        return []
    from lora_conformance.report.environment import device_info, package_versions

    s = get_settings(config)
    versions = package_versions()
    lines = [
        f"lora-conformance: engine={s.engine} device={s.device} ({device_info(s.device)['device_name']}) dtype={s.dtype} "
        f"base-model={s.base_model}",
        f"lora-conformance: reference={s.reference_device}/{s.reference_dtype} cache={s.cache_dir} "
        f"engine-args={json.dumps(s.engine_args, sort_keys=True)}",
        "lora-conformance: " + " ".join(f"{k}={versions[k]}" for k in ("torch", "transformers", "peft")),
        f"lora-conformance: processes={parallel.xdist_workers(config)} {s.threads.describe()} per process",
    ]
    non_default = {k: v for k, v in s.sources.items() if v != "default"}
    if non_default:
        lines.append("lora-conformance: settings from " + ", ".join(f"{k}<-{v}" for k, v in sorted(non_default.items())))
    return lines


# ---- collection ------------------------------------------------------------------------


def _device_types_of(item: pytest.Item) -> set[str] | None:
    types: set[str] = set()
    found = False
    for m in item.iter_markers("device"):
        found = True
        types.update(m.args)
    for name in SHORTHAND_TYPES:
        if item.get_closest_marker(name) is not None:
            found = True
            types.add(name)
    return types if found else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if SETTINGS_KEY not in metafunc.config.stash:
        return
    s = get_settings(metafunc.config)
    # Ids carry the device type (not its index: xdist workers must collect identical ids).
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", [s.device], ids=[s.device_type], scope="session")
    if "dtype" in metafunc.fixturenames and not any(m.args and m.args[0] == "dtype" for m in metafunc.definition.iter_markers("parametrize")):
        metafunc.parametrize("dtype", [s.dtype], ids=[s.dtype], scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SETTINGS_KEY not in config.stash:
        return
    from lora_conformance.engines.base import Capability
    from lora_conformance.features import FeatureMarkerError, feature_of_item, required_capabilities

    s = get_settings(config)
    owners: dict[str, str] = {}  # feature id -> the test function that declares it
    for item in items:
        types = _device_types_of(item)
        if types is not None and s.device_type not in types:
            item.add_marker(pytest.mark.skip(
                reason=f"not applicable: test is for {', '.join(sorted(types))}, running on {s.device_type}"))
        try:
            feature = feature_of_item(item)
        except FeatureMarkerError as exc:
            raise pytest.UsageError(str(exc)) from None
        if feature is not None:
            function = item.nodeid.split("[", 1)[0]
            if owners.setdefault(feature.id, function) != function:
                raise pytest.UsageError(f"{function}: feature id {feature.id!r} is already declared by "
                                        f"{owners[feature.id]} (one test function per feature)")
        for cap in required_capabilities(item):
            try:
                Capability.parse(cap)
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: required capability: {exc}") from None
    from lora_conformance import run_order

    durations = run_order.worker_durations(config)
    if durations:  # pytest-xdist worker: the long tests first (identical in every worker)
        items[:] = run_order.order(items, durations)


def _discard_engines(config: pytest.Config) -> None:
    if HARNESS_KEY in config.stash:
        config.stash[HARNESS_KEY].discard_engines()


# ---- fixtures --------------------------------------------------------------------------


def _harness(config: pytest.Config):
    if HARNESS_KEY not in config.stash:
        from lora_conformance.harness import Harness
        from lora_conformance.report.recorder import ENV_KEY

        # Before the first engine or reference: a worker gets its share of the cores.
        parallel.apply_thread_share(get_settings(config).threads)
        environment = config.stash.setdefault(ENV_KEY, {})
        config.stash[HARNESS_KEY] = Harness(get_settings(config), environment)
    return config.stash[HARNESS_KEY]


@pytest.fixture(scope="session")
def lora_settings(pytestconfig: pytest.Config) -> Settings:
    """The resolved settings of this run."""
    return get_settings(pytestconfig)


@pytest.fixture(scope="session")
def lora_harness(pytestconfig: pytest.Config):
    """Session services: models, adapters, references, engines (see lora_conformance.harness)."""
    harness = _harness(pytestconfig)
    yield harness
    harness.close()


@pytest.fixture
def lora(request: pytest.FixtureRequest, lora_harness):
    """Per-test view of the harness: the item's base model, dtype and capability gate applied."""
    from lora_conformance.harness import TestContext

    ctx = TestContext(lora_harness, request)
    yield ctx
    ctx.close()


@pytest.fixture(autouse=True)
def _lora_capability_gate(request: pytest.FixtureRequest) -> None:
    """Skip, as *not certified*, a test whose required capabilities the engine does not declare."""
    from lora_conformance.features import required_capabilities
    from lora_conformance.outcomes import missing_capabilities

    needed = required_capabilities(request.node)
    if not needed:
        return
    harness = _harness(request.config)
    missing = harness.missing_capabilities(request, needed)
    if missing:
        missing_capabilities(missing)


# ---- environment facts from pytest-xdist workers ------------------------------------------


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Workers create the engines; what only a live engine knows travels to the controller here.
    config = session.config
    if exitstatus == pytest.ExitCode.INTERRUPTED and not hasattr(config, "workeroutput"):
        from lora_conformance.report.recorder import ENV_KEY  # the partial report says it is one

        config.stash.setdefault(ENV_KEY, {})["interrupted"] = True
    if hasattr(config, "workeroutput") and HARNESS_KEY in config.stash:
        config.workeroutput["lora_environment"] = json.dumps(config.stash[HARNESS_KEY].environment, default=str)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    raw = getattr(node, "workeroutput", {}).get("lora_environment")
    if raw:
        from lora_conformance.report.recorder import ENV_KEY

        environment = node.config.stash.setdefault(ENV_KEY, {})
        for key, value in json.loads(raw).items():
            environment.setdefault(key, value)


# ---- evidence for the report -----------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # The one writer of the structured facts the report reads (lora_conformance.evidence): the
    # feature, a not-certified outcome with its cause, a failure's type and message, a comparison's
    # evidence. User properties are JSON strings: they cross from xdist workers.
    from lora_conformance import evidence

    evidence.attach_call_facts(item, call.excinfo)
    if call.excinfo is not None and HARNESS_KEY in item.config.stash:
        from lora_conformance.engines.base import EngineFailure

        if isinstance(call.excinfo.value, EngineFailure):
            item.config.stash[HARNESS_KEY].discard_engines()
    yield


def pytest_deselected(items: list) -> None:
    # On a pytest-xdist worker: the cases it deselected (-k, -m, --lf, CI shards) travel to the
    # controller's report, which records what a run left out (report.recorder).
    if items and hasattr(items[0].config, "workeroutput"):
        from lora_conformance.report.recorder import ship_deselected

        ship_deselected(items[0].config, items)
