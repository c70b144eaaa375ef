"""The session's engine pool behind the ``lora`` fixture (``lora_conformance.context``).

``Harness`` lives for the session (one per pytest process): it starts engines, shares them
between the tests that ask for the same model, dtype and effective settings, keeps the ledger
of engine starts the report shows, and closes them. Models, adapters and references come from
its ``Workspace`` (``lora_conformance.workspace``); verdicts are the judge's
(``lora_conformance.judge``), never the pool's.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import pytest

from lora_conformance.markers import base_model_kind
from lora_conformance.settings import Settings, get_settings
from lora_conformance.workspace import Workspace
# Engines kept alive at once (least recently used closed first, the run's own engine last): each
# settings combination a suite asks for keeps its engine, so the next test with those settings
# starts none.
MAX_LIVE_ENGINES = 3
HARNESS_KEY = pytest.StashKey["Harness"]()


def session_harness(config: pytest.Config, environment: dict) -> "Harness":
    """This process's harness, made on first use, filling ``environment`` (the facts the report
    records about the engine)."""
    if HARNESS_KEY not in config.stash:
        from lora_conformance import parallel

        # Before the first engine or reference: a worker gets its share of the cores.
        parallel.apply_thread_share(get_settings(config).threads)
        config.stash[HARNESS_KEY] = Harness(get_settings(config), environment, run_dir=shared_run_dir(config))
    return config.stash[HARNESS_KEY]


def shared_run_dir(config: Any) -> Optional[Path]:
    """The folder the pytest-xdist workers of this run share: the parent of their base temp dirs
    (xdist gives each worker ``<the run's base temp>/<worker id>``); None in a run of one process."""
    basetemp = getattr(getattr(config, "option", None), "basetemp", None)
    if not hasattr(config, "workerinput") or not basetemp:
        return None
    return Path(basetemp).resolve().parent


def existing_harness(config: pytest.Config) -> Optional["Harness"]:
    """This process's harness, or None where no test has asked for one yet."""
    return config.stash.get(HARNESS_KEY, None)


class Harness:
    def __init__(self, settings: Settings, environment: Optional[dict] = None, run_dir: Optional[Path] = None):
        self.settings = settings
        # Shared with the run's other pytest-xdist workers (None: this process is the run): an engine
        # that failed to start in one worker is not started again in another (shared_engine).
        self.run_dir = run_dir
        # Filled with what only a live engine knows (version, capabilities, limits), for the report.
        self.environment = environment if environment is not None else {}
        self.workspace = Workspace(settings)
        self._engines: "OrderedDict[tuple, Any]" = OrderedDict()
        self._engine_failures: dict[tuple, BaseException] = {}
        self._engine_extra: dict[tuple, dict] = {}  # shared engine key -> the test's args it was started with
        self._declared: dict[Path, Any] = {}  # model dir -> the engine class's declared capabilities
        self._activations: dict[tuple, Optional[str]] = {}  # (model dir, dtype) -> declared activations
        # Engine starts not yet attached to a test (the plugin's makereport takes them, take_starts),
        # and why each shared engine that was started before is gone (its next start says so).
        self._starts: list[dict] = []
        self._n_starts = 0  # this process's starts so far (numbers them)
        self._gone: dict[tuple, str] = {}
        self.prompt_logprobs_probes: dict[tuple, str] = {}  # (model, dtype) -> '' or what broke
        self._closing: list[Any] = []  # threads closing retired engines (cpu), joined by close()
        self._uses: set[str] = set()  # shared engines other than the run's own asked for since take_uses
        self._own: Optional[tuple] = None  # _own_key's answer
        self._close_errors: list[BaseException] = []
        # Decodes of this process's tests that the end-of-run audit may ask again (judge.audit),
        # by node id; a case counts once its test passed (audit_passed).
        self.audit_cases: dict[str, Any] = {}

    # ---- engines ---------------------------------------------------------------------

    def engine_args(self, extra: Mapping[str, Any]) -> dict[str, str]:
        # The user's --engine-arg values first; a test's own requirements win.
        return {**self.settings.engine_args, **{k: str(v) for k, v in extra.items()}}

    def create_engine(self, model_dir: Path, dtype: str, extra: Mapping[str, Any], why: str = "fresh engine"):
        """A new engine; an engine that refuses to start with this model, dtype or these args
        (UnsupportedFeatureError) makes the test *not certified* (cause ``refused``), not failed.
        The start (its seconds and ``why``) goes to the report with the test that caused it."""
        import time

        from lora_conformance.engines import UnsupportedFeatureError, create_engine
        from lora_conformance.outcomes import REFUSED, not_certified

        args = self.engine_args(extra)
        shown = ", ".join(f"{k}={v}" for k, v in sorted(args.items())) or "no engine args"
        started = time.perf_counter()
        try:
            return create_engine(self.settings.engine, model_dir, self.settings.device, dtype, args)
        except UnsupportedFeatureError as exc:
            why += "; refused to start"
            not_certified(REFUSED, f"engine {self.settings.engine!r} refused to start ({model_dir.name}, {dtype}, "
                                   f"{shown}): {exc}")
        except BaseException:
            why += "; failed to start"
            raise
        finally:
            self._starts.append({"engine": f"{model_dir.name}, {dtype}, {shown}",
                                 "seconds": round(time.perf_counter() - started, 2), "why": why,
                                 "n": self._n_starts})
            self._n_starts += 1

    def engine_args_of(self, engine) -> Optional[dict]:
        """The test's own engine args a shared engine was started with (None: not a shared engine)."""
        key = next((k for k, e in self._engines.items() if e is engine), None)
        return None if key is None else self._engine_extra.get(key, {})

    def audit_passed(self, nodeid: str) -> None:
        if nodeid in self.audit_cases:
            self.audit_cases[nodeid].passed = True

    def take_starts(self) -> list[dict]:
        """The engine starts since the last call (the plugin attaches them to the running test)."""
        taken, self._starts = self._starts, []
        return taken

    def take_uses(self) -> list[str]:
        """The shared engines other than the run's own that were asked for since the last call, as
        stable labels (model name, dtype, effective settings): the plugin hands them to the
        controller, which keeps them beside the durations, so that the next run under ``--dist
        loadfile`` sends files that share such an engine to one worker (``run_order.file_groups``)."""
        taken, self._uses = sorted(self._uses), set()
        return taken

    def _own_key(self) -> Optional[tuple]:
        """The run's own engine's key (its model, dtype and the user's args), computed once."""
        if self._own is None:
            try:
                self._own = self.engine_key(self.workspace.model_dir(self.workspace.model_spec(None)), self.settings.dtype, {})
            except Exception:  # noqa: BLE001 - a base model that does not resolve has no engine to keep
                return None
        return self._own

    def engine_key(self, model_dir: Path, dtype: str, extra: Mapping[str, Any]) -> tuple:
        """What identifies a shared engine: the model, the dtype and the engine's *effective*
        settings (``Engine.sharing_key`` of the parsed args), so that a test asking for a value
        the engine has anyway (``prefix_cache=1`` where caching is the default) shares the engine
        started without it. Args that do not parse keep their raw strings: create_engine then
        reports the problem, once."""
        args = self.engine_args(extra)
        try:
            cls, cfg = self.parsed_engine_args(args)
            ident = cls.sharing_key(cfg, model_dir, self.settings.device)
        except Exception:  # noqa: BLE001 - any parse problem is create_engine's to report
            ident = tuple(sorted(args.items()))
        return (str(model_dir), dtype, ident)

    def parsed_engine_args(self, args: Mapping[str, str]):
        """(the engine class, its parsed ``Args``) for these engine args; parse errors propagate."""
        from lora_conformance.engines import engine_class

        cls = engine_class(self.settings.engine)
        return cls, cls.parse_args(args, self.settings.sources.get("engine_arg", "command line"))

    def shared_engine(self, model_dir: Path, dtype: str, extra: Mapping[str, Any] = {}):
        """An engine shared by the tests that ask for the same model, dtype and effective settings."""
        key = self.engine_key(model_dir, dtype, extra)
        if key != self._own_key():
            self._uses.add(f"{Path(key[0]).name}, {key[1]}, {key[2]}")
        if key in self._engine_failures:
            raise self._engine_failures[key]
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        # First use here only: an engine this worker has run before is worth its own start.
        elsewhere = None if key in self._gone else self._start_failed_elsewhere(key)
        if elsewhere is not None:
            self._engine_failures[key] = elsewhere
            raise elsewhere
        while len(self._engines) >= MAX_LIVE_ENGINES:
            old_key = self._eviction_victim()
            old = self._engines.pop(old_key)
            self._gone[old_key] = f"closed for a newer engine (at most {MAX_LIVE_ENGINES} live)"
            self.retire(old)
        from lora_conformance.outcomes import NotCertified

        why = f"shared engine, started again: {self._gone[key]}" if key in self._gone else "shared engine, first use"
        try:
            engine = self.create_engine(model_dir, dtype, extra, why)
        except (Exception, NotCertified) as exc:  # NotCertified is a pytest skip, a BaseException
            self._engine_failures[key] = exc  # do not retry a failing start (or a refusal) for every test
            self._share_start_failure(key, exc)
            raise
        self._engines[key] = engine
        self._engine_extra[key] = dict(extra)
        self._record(engine)
        return engine

    # A start that failed (EngineFailure: the engine could not come up) is written to the run's shared
    # folder, so that another worker's tests of that engine get the same failure, saying where it was
    # met, instead of a start of their own that fails alike (an SGLang start is tens of seconds). A
    # refusal (not certified) is cheap and not shared.
    FAILED_STARTS = "lora-failed-starts"

    def _failed_start_file(self, key: tuple) -> Optional[Path]:
        import hashlib

        if self.run_dir is None:
            return None
        return self.run_dir / self.FAILED_STARTS / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.json"

    def _share_start_failure(self, key: tuple, exc: BaseException) -> None:
        import os

        from lora_conformance.engines import EngineFailure
        from lora_conformance.fileio import write_json_atomic

        path = self._failed_start_file(key)
        if path is None or not isinstance(exc, EngineFailure):
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"engine": f"{Path(key[0]).name}, {key[1]}", "message": str(exc),
                                     "worker": os.environ.get("PYTEST_XDIST_WORKER", "another worker")})
        except OSError:
            pass  # sharing only saves time: the other workers then start it themselves

    def _start_failed_elsewhere(self, key: tuple) -> Optional[BaseException]:
        """The EngineFailure another worker of this run met starting this engine, or None."""
        import json

        from lora_conformance.engines import EngineFailure

        path = self._failed_start_file(key)
        if path is None or not path.exists():
            return None
        try:
            met = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return EngineFailure(f"{met['message']} [this engine failed to start in pytest-xdist worker {met['worker']} "
                             "of this run; not started again here]")

    def _eviction_victim(self) -> tuple:
        """The shared engine to close for a new one: the least recently used, but the run's own
        engine (the run's model, dtype and the user's args, which most tests use) only when every
        live engine is one."""
        own = self._own_key()
        return next((k for k in self._engines if k != own), next(iter(self._engines)))

    def retire(self, engine, swallow: bool = False) -> None:
        """Close an engine the run no longer uses. On cpu the close runs on a thread of its own
        while the next test goes on: a vLLM engine takes about 4.5 s to stop, almost all of it
        waiting for its processes to exit (no cpu), and a certification closes one or two dozen.
        The thread is no daemon, and ``close`` (the session's end, an interrupted run's too) joins
        every one and raises the first close error. On an accelerator the close finishes first, so
        that the next engine finds the device memory free. ``swallow``: the engine may be dead,
        its close failing is no news."""
        from lora_conformance import devices

        if devices.device_type(self.settings.device) == devices.CPU:
            self._close_on_thread(engine, swallow)
            return
        self._close(engine, swallow)
        if self._close_errors:
            raise self._close_errors.pop(0)

    def _close(self, engine, swallow: bool = False) -> None:
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - raised by close(), or by retire on an accelerator
            if not swallow:
                self._close_errors.append(exc)

    def _close_on_thread(self, engine, swallow: bool = False) -> None:
        import threading

        thread = threading.Thread(target=self._close, args=(engine, swallow), name=f"close {type(engine).__name__}",
                                  daemon=False)
        thread.start()
        self._closing.append(thread)

    def _record(self, engine) -> None:
        if "engine" not in self.environment:
            self.environment["engine"] = {
                "version": engine.version(),
                "capabilities": sorted(c.value for c in engine.capabilities),
                "limits": dataclasses.asdict(engine.limits),
            }
            settings = getattr(engine, "settings", None)
            if callable(settings):
                # Every effective engine setting, and where ours differ from the engine's defaults.
                self.environment["engine"]["settings"] = settings()

    def reset_adapters(self, engine, note=None):
        """Before a test uses a shared engine: unload every adapter, then ask the engine itself
        (``engine_adapters``) that none is left, so that an adapter loaded by an earlier test can
        never make this one pass. An engine that still reports adapters is replaced by a fresh one
        (``note`` says so in the report); the unload suites judge that behaviour themselves.
        Returns the engine the test must use."""
        from lora_conformance.engines.base import EngineError

        leftover: list[str] = []
        try:
            for name in list(engine.list_adapters()):
                engine.unload_adapter(name)
            leftover = list(engine.list_adapters()) + list(engine.engine_adapters() or [])
        except EngineError as exc:
            leftover = [f"(reset failed: {type(exc).__name__}: {exc})"]
        if not leftover:
            return engine
        key = next((k for k, e in self._engines.items() if e is engine), None)
        if key is None:
            raise AssertionError(f"the engine still reports adapters {leftover} after unloading every adapter")
        del self._engines[key]
        try:
            self.retire(engine, swallow=True)
        except Exception:  # noqa: BLE001 - it is dropped either way
            pass
        if note is not None:
            note(f"the shared engine still reported adapters {leftover} after unloading every adapter; "
                 "this test ran on a fresh engine")
        fresh = self.create_engine(Path(key[0]), key[1], self._engine_extra[key],
                                   "shared engine replaced: it still reported adapters after unloading every one")
        self._engines[key] = fresh
        return fresh

    def missing_capabilities(self, request: pytest.FixtureRequest, needed: Iterable[str]) -> list[str]:
        """The capabilities in ``needed`` the engine does not declare for this test's model and the user's
        args. The engine class answers without starting anything; only where it cannot tell (None) is
        the shared engine started and asked."""
        from lora_conformance.engines.base import Capability

        model_dir = self.workspace.model_dir(self.workspace.model_spec(base_model_kind(request.node)))
        declared = self.declared_capabilities(model_dir)
        if declared is None:
            # A refusal to start with this model (UnsupportedFeatureError) is raised as not certified.
            declared = self.shared_engine(model_dir, item_dtype(request, self.settings)).capabilities
        return [c for c in needed if Capability.parse(c) not in declared]

    def not_declared_reasons(self, request: pytest.FixtureRequest) -> dict[str, str]:
        """capability name -> why the engine does not declare it for this test's model
        (``Engine.not_declared_reasons``)."""
        model_dir = self.workspace.model_dir(self.workspace.model_spec(base_model_kind(request.node)))

        try:
            cls, cfg = self.parsed_engine_args(self.settings.engine_args)
            reasons = cls.not_declared_reasons(cfg, model_dir, self.settings.device)
        except Exception:  # noqa: BLE001 - the reasons only explain; the verdict stands without them
            return {}
        return {getattr(c, "value", str(c)): why for c, why in reasons.items()}

    def declared_activations(self, model_dir: Path, dtype: Optional[str] = None) -> Optional[str]:
        """The activation scheme the engine's quantised-base matmuls read on this model with the user's
        args (``Engine.declared_activations``; None: the run's dtype), which widens the judge's rows
        (judge/tolerances.py ``ACTIVATIONS``). Args that do not parse: None (the engine's start reports them).
        Asked once per model and dtype (every test's judge asks; the answer reads the model's manifest)."""
        key = (model_dir, dtype)
        if key not in self._activations:
            try:
                cls, cfg = self.parsed_engine_args(self.settings.engine_args)
            except Exception:  # noqa: BLE001 - create_engine reports bad args, once
                self._activations[key] = None
            else:
                self._activations[key] = cls.declared_activations(cfg, model_dir, self.settings.device, dtype)
        return self._activations[key]

    def declared_capabilities(self, model_dir: Path):
        """The engine class's own answer (``Engine.declared_capabilities``) for the user's engine args,
        or None where only a started engine can tell."""
        if model_dir not in self._declared:
            from lora_conformance.engines.args import class_capabilities

            cls, cfg = self.parsed_engine_args(self.settings.engine_args)
            self._declared[model_dir] = class_capabilities(cls, cfg, model_dir, self.settings.device)
        return self._declared[model_dir]

    def drop(self, engine, why: str) -> None:
        """Close a shared engine the run must not use again (``why``: the next start of its settings
        says so in the report)."""
        key = next((k for k, e in self._engines.items() if e is engine), None)
        if key is not None:
            del self._engines[key]
            self._gone[key] = why
        self.retire(engine, swallow=True)

    def discard_engines(self) -> None:
        """Close every shared engine: after an EngineFailure one may be dead, and a dead engine
        must fail only the test that broke it, not every test after it."""
        while self._engines:
            key, engine = self._engines.popitem()
            self._gone[key] = "closed after an engine failure"
            self.retire(engine, swallow=True)  # closing a dead engine may fail too; it is dropped either way

    def close(self) -> None:
        """Close every engine, the live ones side by side (each close waits for its own processes),
        and wait for the closes ``retire`` started; the first close error is raised once every
        engine had its close."""
        while self._engines:
            self._close_on_thread(self._engines.popitem()[1])
        while self._closing:
            self._closing.pop(0).join()
        if self._close_errors:
            raise self._close_errors.pop(0)


def item_dtype(request: pytest.FixtureRequest, settings: Settings) -> str:
    """The dtype a test runs in: its ``dtype`` parameter, else the run's."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "dtype" in callspec.params:
        return callspec.params["dtype"]
    return settings.dtype
