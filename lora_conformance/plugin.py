"""The lora-conformance pytest plugin: options, hooks and fixtures.

Loaded only where a run asks for it, never into every pytest run of the environment (the pytest11
entry point, ``lora_conformance.autoload``, leaves other projects' runs alone): by the suites' own
``conftest.py`` (``pytest suites ...``), by ``-p lora_conformance.plugin`` (what ``lora-conformance
certify`` passes; any project's tests can use it too), or by ``--pyargs lora_conformance.suites``.

Thin by design: importing this module imports pytest and our option and marker tables only.
torch, transformers, PEFT and engines load inside hooks and fixtures, and only when a run needs
them, so ``pytest --help`` stays fast and touches no accelerator. What the hooks do is owned
elsewhere: the settings (``options``, ``settings``), the markers (``markers``, ``features``), the test order
(``run_order``), the session services (``harness``), the report (``report.recorder``).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest

from lora_conformance import options, parallel
from lora_conformance.markers import MARKERS
from lora_conformance.options import resolve_settings
from lora_conformance.settings import SETTINGS_KEY, WORKER_CHOICE_KEY, Settings, check_writable_dirs, get_settings

# ---- options and settings --------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if config.getoption("help", False) or config.getoption("version", False):
        return
    settings = resolve_settings(config)
    config.stash[SETTINGS_KEY] = settings
    from lora_conformance import gc_tuning

    config.pluginmanager.register(gc_tuning, "lora-conformance-gc")
    if not hasattr(config, "workerinput"):
        check_writable_dirs(settings)
        told = getattr(config.option, "numprocesses", None)  # -n N (auto resolved: within the fit already)
        if isinstance(told, int):
            overcommit = parallel.device_overcommit(settings.device, settings.profile, told)
            if overcommit:
                config.issue_config_time_warning(pytest.PytestConfigWarning(overcommit), stacklevel=2)
    _register_subplugins(config, settings)
    from lora_conformance import run_order

    run_order.configure(config, run_order.settings_durations_path(settings))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    # pytest-xdist controller: every worker orders its collection by the same durations.
    from lora_conformance import run_order

    if SETTINGS_KEY in node.config.stash:
        node.workerinput[run_order.WORKERINPUT_KEY] = run_order.node_input(node.config)
        node.workerinput[run_order.DIST_KEY] = node.config.getoption("dist", None)
        node.workerinput[run_order.GROUPS_KEY] = run_order.groups_input(node.config)
        node.workerinput[run_order.LAST_KEY] = run_order.last_input(node.config)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config):
    # -n auto: the workers for this machine and these settings (certify asks for -n auto too);
    # pytest-xdist's own PYTEST_XDIST_AUTO_NUM_WORKERS, where the user set it, wins.
    import os

    from lora_conformance import run_order

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None

    try:
        settings = resolve_settings(config)
    except Exception:  # noqa: BLE001 - pytest_configure reports a bad setting, in one line
        return None
    paths = [config.invocation_params.dir / str(a).split("::", 1)[0] for a in config.args]
    choice = parallel.workers_for_run(settings.device, run_order.recorded_work(
        run_order.settings_durations_path(settings),
        config.rootpath, [p for p in paths if p.exists()]), settings.profile)
    config.stash[WORKER_CHOICE_KEY] = choice
    return choice.workers


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any):
    # --dist load: longest first, one test at a time; --dist loadfile: files that shared an engine in
    # the last run go to one worker (run_order.make_scheduler).
    if SETTINGS_KEY not in config.stash:
        return None
    from lora_conformance import run_order

    return run_order.make_scheduler(config, log)


def _register_subplugins(config: pytest.Config, settings: Settings) -> None:
    from lora_conformance.expectations import ExpectationsPlugin, default_expectations_path

    if settings.test_timeout:
        from lora_conformance.time_budget import TimeBudget

        config.pluginmanager.register(TimeBudget(settings.test_timeout, settings.sources.get("lora_test_timeout", "default"),
                                                 on_timeout=_engines_failed),
                                      "lora-conformance-time-budget")

    if settings.certified:
        from lora_conformance.certification import run_refusal
        from lora_conformance.settings import suites_dir

        refusal = run_refusal(config, suites_dir())
        if refusal:
            raise options.OptionError(f"--lora-certified: {refusal}")
    path = settings.expectations or default_expectations_path(settings.engine, settings.device_type)
    if path is not None:
        config.pluginmanager.register(ExpectationsPlugin(path, settings.certified), "lora-conformance-expectations")
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
        f"base-model={s.base_model}" + ("" if s.base_quant == "none" else f" base-quant={s.base_quant}"),
        f"lora-conformance: reference={s.reference_device}/{s.reference_dtype} cache={s.cache_dir} "
        f"engine-args={json.dumps(s.engine_args, sort_keys=True)}",
        "lora-conformance: " + " ".join(f"{k}={versions[k]}" for k in ("torch", "transformers", "peft")),
        f"lora-conformance: processes={parallel.xdist_workers(config)} {s.threads.describe()} per process",
    ]
    choice = config.stash.get(WORKER_CHOICE_KEY, None)
    if choice is not None:
        lines.append(f"lora-conformance: -n auto chose {choice.workers} workers ({choice.reason})")
    non_default = {k: v for k, v in s.sources.items() if v != "default"}
    if non_default:
        lines.append("lora-conformance: settings from " + ", ".join(f"{k}<-{v}" for k, v in sorted(non_default.items())))
    return lines


# ---- collection ------------------------------------------------------------------------


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
    from lora_conformance import run_order
    from lora_conformance.features import FeatureMarkerError, check_declarations
    from lora_conformance.markers import device_types_of

    s = get_settings(config)
    for item in items:
        types = device_types_of(item)
        if types is not None and s.device_type not in types:
            item.add_marker(pytest.mark.skip(
                reason=f"not applicable: test is for {', '.join(sorted(types))}, running on {s.device_type}"))
    try:
        check_declarations(items)
    except FeatureMarkerError as exc:
        raise pytest.UsageError(str(exc)) from None
    durations = run_order.worker_durations(config)
    if durations:  # pytest-xdist worker: the long tests (files) first, identical in every worker
        items[:] = run_order.order(items, durations, by_file=run_order.worker_dist(config) == "loadfile",
                                   groups=run_order.worker_groups(config), last=run_order.worker_last(config))


def _harness(config: pytest.Config):
    from lora_conformance.harness import session_harness
    from lora_conformance.report.recorder import run_environment

    return session_harness(config, run_environment(config))


def _engines_failed(item: pytest.Item) -> None:
    """``item``'s engine failed (an EngineFailure, or past its time budget): close every shared
    engine of this process, and mark the test to run last next time (``run_order``)."""
    from lora_conformance import run_order
    from lora_conformance.harness import existing_harness

    harness = existing_harness(item.config)
    if harness is not None:
        harness.discard_engines()
    item.user_properties.append((run_order.DIED_PROPERTY, "1"))


# ---- fixtures --------------------------------------------------------------------------


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
    from lora_conformance.context import TestContext

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
        missing_capabilities(missing, harness.not_declared_reasons(request))


# ---- environment facts from pytest-xdist workers ------------------------------------------


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Workers create the engines; what only a live engine knows travels to the controller here.
    config = session.config
    if exitstatus == pytest.ExitCode.INTERRUPTED and not hasattr(config, "workeroutput"):
        from lora_conformance.report.recorder import run_environment  # the partial report says it is one

        run_environment(config)["interrupted"] = True
    from lora_conformance.harness import existing_harness

    harness = existing_harness(config)
    if harness is not None and exitstatus != pytest.ExitCode.INTERRUPTED:
        import random

        from lora_conformance.context import audit_at_end, run_audit
        from lora_conformance.report.recorder import keep_audit

        audit_at_end(config, harness, random.SystemRandom().randrange(2**31), run_audit, keep_audit)
    if hasattr(config, "workeroutput") and harness is not None:
        from lora_conformance.report.recorder import ship_environment

        ship_environment(config, harness.environment)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    from lora_conformance.report.recorder import receive_audit, receive_environment

    receive_environment(node)
    receive_audit(node)



# ---- evidence for the report -----------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # The one writer of the structured facts the report reads (lora_conformance.evidence): the
    # feature, a not-certified outcome with its cause, a failure's type and message, a comparison's
    # evidence. User properties are JSON strings: they cross from xdist workers.
    from lora_conformance import evidence

    evidence.attach_call_facts(item, call.excinfo)
    from lora_conformance.harness import existing_harness

    harness = existing_harness(item.config)
    if harness is not None:
        starts = harness.take_starts()
        if starts:  # the engines this phase started, with their seconds and why
            evidence.add(item, evidence.ENGINE_STARTS, starts)
        uses = harness.take_uses()
        if uses:  # for the next run's scheduling only (run_order), not the report
            from lora_conformance import run_order

            item.user_properties.append((run_order.USES_PROPERTY, json.dumps(uses)))
        if call.when == "teardown":  # this process's reference work so far: a run stopped early says it too
            from lora_conformance.report.recorder import REFERENCE_WORK_PROPERTY

            work = harness.workspace.reference_work()
            if work:
                item.user_properties.append((REFERENCE_WORK_PROPERTY, json.dumps(work)))
            peaks = _device_memory_peaks(harness.settings.device)
            if peaks:  # and what it held on the device at most while this test ran
                from lora_conformance.report.recorder import DEVICE_MEMORY_PROPERTY

                item.user_properties.append((DEVICE_MEMORY_PROPERTY, json.dumps(peaks)))
        if call.excinfo is not None:
            from lora_conformance.engines.base import EngineFailure

            if isinstance(call.excinfo.value, EngineFailure):
                _engines_failed(item)
    outcome = yield
    report = outcome.get_result()
    if harness is not None and report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        harness.audit_passed(item.nodeid)  # its decode may be audited at the end of the run (judge.audit)


def pytest_deselected(items: list) -> None:
    # On a pytest-xdist worker: the cases it deselected (-k, -m, --lf, CI shards) travel to the
    # controller's report, which records what a run left out (report.recorder).
    if items and hasattr(items[0].config, "workeroutput"):
        from lora_conformance.report.recorder import ship_deselected

        ship_deselected(items[0].config, items)


def _device_memory_peaks(device: str) -> Optional[dict]:
    """``devices.memory_peaks`` since the last call, for the report (the peaks are reset after each
    reading: each test's own show); None where it cannot say (a device whose runtime gives no figures
    must not fail a test's teardown)."""
    from lora_conformance import devices

    try:
        peaks = devices.memory_peaks(device)
        if peaks:
            devices.reset_peak_memory(device)
        return peaks
    except Exception:  # noqa: BLE001 - a figure for the report, never a test's failure
        return None
