"""What an engine start costs is visible and kept low: every start is recorded with its seconds and
why (the report's Run table sums them), the run's own engine is the last one closed for a newer
one, engines close off the test's critical path on cpu (and close() waits for them), a probe runs
once per run, not once per pytest-xdist worker, and on the shared engine where it can, and a start
that failed in one worker is not tried again in another (each test it affects still fails, saying so)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_conformance import harness as harness_mod
from lora_conformance.engines import Capability
from lora_conformance.evidence import Record
from tests.test_harness_sharing import STARTED, CountingEngine, _context
from tests.test_harness_sharing import _harness as sharing_harness


class SlowClosingEngine(CountingEngine):
    """Takes a while to close, from whichever thread; ``fail_close`` raises instead."""

    fail_close = False
    close_threads: list[str] = []

    def close(self):
        time.sleep(0.3)
        type(self).close_threads.append(threading.current_thread().name)
        if self.fail_close:
            raise RuntimeError("could not stop the worker")
        self.closed = True


class FailingCloseEngine(SlowClosingEngine):
    fail_close = True


def _harness(tmp_path: Path, engine: str = "CountingEngine"):
    return sharing_harness(tmp_path, engine, module=__name__)


def _own_model(harness, tmp_path: Path) -> None:
    # the run's base model resolves to the directory the test contexts use
    harness.workspace._model_dirs[harness.settings.base_model] = tmp_path


def test_every_start_is_recorded_with_why(tmp_path):
    STARTED.clear()
    h = _harness(tmp_path)
    _own_model(h, tmp_path)
    ctx = _context(h, tmp_path)
    ctx.engine
    for rank in (8, 16, 32):  # the third newer engine closes one: not the run's own
        ctx.engine_with(max_rank=rank)
    ctx.engine_with(max_rank=8)  # closed for max_rank=32: started again, and says so
    ctx.fresh_engine()
    starts = h.take_starts()
    assert [s["why"] for s in starts] == [
        "shared engine, first use", "shared engine, first use", "shared engine, first use",
        "shared engine, first use",
        f"shared engine, started again: closed for a newer engine (at most {harness_mod.MAX_LIVE_ENGINES} live)",
        "a fresh engine for this test"]
    assert [s["n"] for s in starts] == list(range(6))
    assert all(s["seconds"] >= 0 and "float32" in s["engine"] for s in starts)
    assert "max_rank=16" in starts[2]["engine"]
    assert h.take_starts() == [], "a start is attached to one test only"
    h.close()


def test_the_runs_own_engine_is_closed_last(tmp_path):
    STARTED.clear()
    h = _harness(tmp_path)
    _own_model(h, tmp_path)
    ctx = _context(h, tmp_path)
    own = ctx.engine
    others = [ctx.engine_with(max_rank=r) for r in (8, 16, 32, 64)]
    h.close()
    assert STARTED[0] is own and len(STARTED) == 5, "the run's own engine was closed and started again"
    assert all(e.closed for e in [own] + others)
    # without the run's own engine among them, the least recently used goes first
    STARTED.clear()
    h = _harness(tmp_path)
    h.workspace._model_dirs[h.settings.base_model] = tmp_path / "another model"
    ctx = _context(h, tmp_path)
    first, second, third = (ctx.engine_with(max_rank=r) for r in (8, 16, 32))
    ctx.engine_with(max_rank=8)  # used again: max_rank=16 is now the least recently used
    ctx.engine_with(max_rank=64)
    live = list(h._engines.values())
    assert first in live and third in live and second not in live
    h.close()


def test_engines_close_on_threads_on_cpu_and_close_waits_for_them(tmp_path):
    SlowClosingEngine.close_threads = []
    h = _harness(tmp_path, "SlowClosingEngine")
    ctx = _context(h, tmp_path)
    engines = [ctx.engine_with(max_rank=r) for r in (8, 16, 32, 64)]  # the fourth closes the first
    fresh = ctx.fresh_engine()
    began = time.perf_counter()
    ctx.close()  # the fresh engine
    assert time.perf_counter() - began < 0.25, "the test's teardown waited for its engine to close"
    began = time.perf_counter()
    h.close()
    assert all(e.closed for e in engines + [fresh]), "close() returned before every engine had closed"
    # the three live at the end close side by side: about one close's time, not three
    assert time.perf_counter() - began < 0.3 * 2.5, "the engines live at the end closed one after another"
    assert len(SlowClosingEngine.close_threads) == 5
    assert all(name.startswith("close ") for name in SlowClosingEngine.close_threads)
    assert not any(t.name.startswith("close ") and t.is_alive() for t in threading.enumerate())


def test_a_close_error_is_raised_by_close_not_lost(tmp_path):
    h = _harness(tmp_path, "FailingCloseEngine")
    ctx = _context(h, tmp_path)
    ctx.fresh_engine()
    ctx.close()
    with pytest.raises(RuntimeError, match="could not stop the worker"):
        h.close()


def test_on_an_accelerator_a_close_finishes_before_the_next_start(tmp_path):
    SlowClosingEngine.close_threads = []
    h = _harness(tmp_path, "SlowClosingEngine")
    h.settings.device = "cuda"
    engine = _context(h, tmp_path).fresh_engine()
    h.retire(engine)
    assert engine.closed and SlowClosingEngine.close_threads == [threading.current_thread().name]
    failing = FailingCloseEngine.__new__(FailingCloseEngine)
    with pytest.raises(RuntimeError, match="could not stop the worker"):
        h.retire(failing)  # raised at once there: nothing later would join it


def _worker_context(tmp_path: Path, worker: str):
    h = _harness(tmp_path)
    ctx = _context(h, tmp_path)
    base = tmp_path / "basetemp" / f"popen-{worker}"
    base.mkdir(parents=True, exist_ok=True)
    # what pytest-xdist gives a worker: its id, and a base temp dir of its own inside the run's
    config = SimpleNamespace(workerinput={"workerid": worker}, option=SimpleNamespace(basetemp=str(base)))
    ctx.request = SimpleNamespace(node=ctx.request.node, config=config)
    ctx.harness.run_dir = harness_mod.shared_run_dir(config)
    return ctx


def test_a_probe_runs_once_per_run_across_workers(tmp_path):
    calls: list[str] = []
    release = threading.Event()

    def probe(worker):
        def run():
            calls.append(worker)
            release.wait(5)
            return "broken: the probe's engine died"
        return run

    gw0, gw1 = _worker_context(tmp_path, "gw0"), _worker_context(tmp_path, "gw1")
    answers: dict[str, str] = {}
    first = threading.Thread(target=lambda: answers.setdefault("gw0", gw0._run_shared(("m", "float32"), probe("gw0"))))
    first.start()
    while not calls:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: answers.setdefault("gw1", gw1._run_shared(("m", "float32"), probe("gw1"))))
    second.start()
    time.sleep(0.3)
    assert "gw1" not in answers, "the second worker did not wait for the first one's answer"
    release.set()
    first.join(5), second.join(5)
    assert calls == ["gw0"] and answers == {"gw0": "broken: the probe's engine died",
                                            "gw1": "broken: the probe's engine died"}
    # another key is probed again
    assert gw1._run_shared(("m", "bfloat16"), lambda: "") == ""


def test_a_worker_asks_itself_when_the_probing_worker_is_gone(tmp_path):
    gw1 = _worker_context(tmp_path, "gw1")
    # a lock left by a worker that died before answering (a pid that is not running)
    gone = 2 ** 22 + 12345
    with pytest.raises(OSError):
        os.kill(gone, 0)
    shared = tmp_path / "basetemp" / "lora-shared-probes"
    shared.mkdir(parents=True)
    import hashlib

    stem = hashlib.sha256(repr(("m", "float32")).encode()).hexdigest()[:24]
    (shared / f"{stem}.lock").write_text(str(gone))
    assert gw1._run_shared(("m", "float32"), lambda: "asked here") == "asked here"


def test_a_serial_run_probes_in_process(tmp_path):
    ctx = _context(_harness(tmp_path), tmp_path)
    ctx.request = SimpleNamespace(node=ctx.request.node, config=SimpleNamespace())
    assert ctx._run_shared(("m", "float32"), lambda: "x") == "x"


def test_the_report_shows_the_starts():
    from lora_conformance.report.markdown import engine_starts_summary

    rec = Record.from_dict({"nodeid": "suites/test_a.py::test_x", "phases": {"call": "passed"},
                            "engine_starts": [{"engine": "m, float32, no engine args", "seconds": 21.5,
                                               "why": "shared engine, first use", "n": 0},
                                              {"engine": "m, float32, no engine args", "seconds": 20.0,
                                               "why": "a fresh engine for this test", "n": 1}]})
    text = engine_starts_summary({"records": [rec.as_dict()]})
    assert text.startswith("2 in 42 s") and "1 shared engine, first use (22 s)" in text
    assert engine_starts_summary({"records": [{"nodeid": "x", "phases": {}}]}) == ""
    with pytest.raises(Exception, match="engine_starts"):
        Record.from_dict({"nodeid": "x", "phases": {}, "engine_starts": ["21 s"]})


def test_a_released_engine_closes_once_before_the_test_ends(tmp_path):
    SlowClosingEngine.close_threads = []
    h = _harness(tmp_path, "SlowClosingEngine")
    ctx = _context(h, tmp_path)
    first, second = ctx.fresh_engine(), ctx.fresh_engine()
    ctx._loaded.append((first, "A"))  # loaded into it by the test: the test's end must not unload it from a closed engine
    first.list_adapters = lambda: pytest.fail("a released engine was asked for its adapters at the test's end")
    began = time.perf_counter()
    ctx.release(first)  # on cpu: on a thread, the test goes on
    assert time.perf_counter() - began < 0.25
    ctx.close()  # the test's end retires the one not released
    h.close()
    assert first.closed and second.closed
    assert len(SlowClosingEngine.close_threads) == 2, "an engine was closed twice"


class FailingStartEngine(CountingEngine):
    """Cannot start: an EngineFailure (its server exited), or a refusal where ``max_rank`` is 8."""

    def __init__(self, model_dir, device, dtype, args):
        from lora_conformance.engines import EngineFailure, UnsupportedFeatureError

        if args.get("max_rank") == "8":
            raise UnsupportedFeatureError("rank 8 refused")
        STARTED.append(self)
        raise EngineFailure("server exited with code -9 during start-up")


def test_a_failed_start_is_met_once_per_run_and_fails_every_test_it_affects(tmp_path, monkeypatch):
    from lora_conformance.engines import EngineFailure
    from lora_conformance.outcomes import NotCertified

    STARTED.clear()
    gw0, gw1 = (_worker_context(tmp_path, w) for w in ("gw0", "gw1"))
    for ctx in (gw0, gw1):
        ctx.harness.settings.engine = f"{__name__}:FailingStartEngine"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(EngineFailure, match="exited with code -9"):
        gw0.engine
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    for _ in range(2):  # every test of that engine in the other worker fails alike, naming where it was met
        with pytest.raises(EngineFailure, match=r"(?s)exited with code -9.*failed to start in pytest-xdist worker gw0"):
            gw1.engine
    assert len(STARTED) == 1 and gw1.harness.take_starts() == [], "the other worker started it again"
    # a refusal (not certified) is each worker's own, and other settings are another engine
    for ctx in (gw0, gw1):
        with pytest.raises(NotCertified):
            ctx.engine_with(max_rank=8)
    with pytest.raises(EngineFailure) as met:
        gw1.engine_with(max_rank=16)
    assert "pytest-xdist worker" not in str(met.value) and len(STARTED) == 2
    # a run of one process shares nothing
    alone = _context(_harness(tmp_path), tmp_path)
    alone.harness.settings.engine = f"{__name__}:FailingStartEngine"
    with pytest.raises(EngineFailure) as met:
        alone.engine
    assert "pytest-xdist worker" not in str(met.value) and len(STARTED) == 3


class ProbedEngine(CountingEngine):
    """Declares prompt logprobs; ``breaks`` makes its generate an EngineFailure."""

    breaks = False

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, args)
        self.capabilities = frozenset({Capability.DYNAMIC_LOADING, Capability.PROMPT_LOGPROBS})
        self.cache_resets = 0

    def reset_prefix_cache(self):
        self.cache_resets += 1
        return True

    def generate(self, requests):
        from lora_conformance.engines import EngineFailure

        if self.breaks:
            raise EngineFailure("engine core died: prompt logprobs requested")
        return []


def _probing_context(tmp_path, monkeypatch, breaks=False):
    monkeypatch.setattr(ProbedEngine, "breaks", breaks)
    h = _harness(tmp_path, "ProbedEngine")
    _own_model(h, tmp_path)
    ctx = _context(h, tmp_path)
    ctx.adapter_path = lambda ref: tmp_path
    ctx.requests = lambda labels, **kw: list(labels)
    return ctx


def test_the_probe_runs_on_the_shared_engine_unless_it_is_the_callers(tmp_path, monkeypatch):
    seen = []
    STARTED.clear()
    ctx = _probing_context(tmp_path, monkeypatch)
    ctx.assert_matches_reference = lambda outs, refs, reqs, label: seen.append(label)
    ctx.reference = lambda reqs: []
    shared = ctx.engine
    caller = ctx.engine_with(chunked_prefill_size=16)
    ctx.harness.take_starts()
    assert ctx._probe_prompt_logprobs(caller) == ""
    assert ctx.harness.take_starts() == [], "the probe started an engine beside the shared one"
    assert shared.cache_resets == 1 and shared.loaded == {} and seen == ["prompt-logprobs probe"]
    # where the caller's engine is the shared one, the probe must not touch it: an engine of its own
    assert ctx._probe_prompt_logprobs(shared) == ""
    assert [s["why"] for s in ctx.harness.take_starts()] == ["the prompt-logprobs probe's own engine"]
    assert STARTED[-1].closed and not shared.closed and shared.cache_resets == 1


def test_a_probe_that_breaks_the_shared_engine_closes_it(tmp_path, monkeypatch):
    STARTED.clear()
    ctx = _probing_context(tmp_path, monkeypatch, breaks=True)
    shared = ctx.engine
    caller = ctx.engine_with(chunked_prefill_size=16)
    answer = ctx._probe_prompt_logprobs(caller)
    assert answer.startswith("a probe with prompt logprobs failed (EngineFailure: engine core died")
    assert shared not in ctx.harness._engines.values(), "the broken shared engine was left in the pool"
    ctx.harness.take_starts()
    again = ctx.engine
    assert again is not shared and not caller.closed
    assert [s["why"] for s in ctx.harness.take_starts()] == [
        "shared engine, started again: the prompt-logprobs probe broke it"]
    ctx.harness.close()
    assert shared.closed
