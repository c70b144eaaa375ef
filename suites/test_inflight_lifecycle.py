"""In-flight lifecycle: adapters loaded, unloaded and reloaded while requests run (``Engine.submit``).

A request is served entirely by the weights its adapter name had when it was submitted: an
unload or a reload of that name must wait for the requests that use it (SGLang drains) or be
refused with ``AdapterInUseError``, never swap weights under them; loading another name meanwhile
must not disturb them. Each test waits until the running requests have produced their first token,
so the change lands while they run; their generations are long enough (48 steps) that they do, and
where an engine finished them before the change was issued (one that decodes 48 steps of the small
base faster than the change can be issued), the test runs again with longer ones (``STEP_LADDER``)
before it calls that a suite defect. Only the requests that use the name are waited for: an engine
may serve the others after them (``start``).

What "waits" can mean to a caller: the requests that use the name (not the base rows running
beside them, which the change need not wait for; they are submitted apart so the two are told
apart) are finished when the change returns, or finish within the time of ``DELIVERY_STEPS`` of
their own decode steps after it. The slack is delivery, not work: an engine behind a server
finishes the requests before it answers the change, but the requests' last answers and the
change's answer travel on connections of their own and may reach this process in either order.
A change that did not wait returns while the requests have most of their steps ahead.
"""

import threading
import time
from dataclasses import dataclass
from typing import Optional

import pytest

from lora_conformance.adapters import AdapterSpec
from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_xpu_ci
from lora_conformance.engines import AdapterInUseError

register_cpu_ci(est_time=20, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=20, suite="per-commit")

pytestmark = pytest.mark.requires("dynamic_loading", "mixed_batch")

STEPS = 48
# Request lengths tried in turn where the requests were done before the change was issued (each attempt
# with nothing changed drains and starts over); 384 tokens and a prompt stay inside a 512-token context.
STEP_LADDER = (STEPS, 96, 192, 384)
TIMEOUT = 300.0
# How many of the requests' own decode steps their last answers may arrive after the change's answer
# (module docstring): an order of two answers on two connections, never decoding left to do.
DELIVERY_STEPS = 3
# ... and never less than this (seconds): on a loaded machine a thread's wake-up alone can take ~10 ms,
# 4 steps of an engine decoding at 2 ms a step (tests/test_inflight_judging.py saw 9 ms). A change that
# waits for nothing returns with most of the requests' steps ahead: 45 x 2.2 ms = 100 ms for the
# built-in engine on cpu, 4x this floor (and fast engines get longer requests, STEP_LADDER).
DELIVERY_FLOOR_S = 0.025
SPECS = {"A": AdapterSpec(seed=9), "B": AdapterSpec(seed=19)}


def long_requests(lora, labels, offset=0, steps=STEPS):
    return lora.requests(labels, prompts=lora.prompts[offset:] + lora.prompts[:offset], max_new_tokens=steps)


@dataclass
class Running:
    """Requests submitted together as two handles: ``users``, those that use the adapter name the
    test changes, and ``beside``, the others (base rows), running at the same time."""

    requests: list
    name: str
    users: object
    beside: Optional[object]
    started_at: float  # when every request had produced its first token
    steps: int = STEPS  # each request's decode steps

    def result(self, timeout):
        """The outputs in the order of ``requests``."""
        users = iter(self.users.result(timeout))
        beside = iter(self.beside.result(timeout) if self.beside is not None else ())
        return [next(users) if r.adapter == self.name else next(beside) for r in self.requests]


def start(lora, engine, reqs, name, steps=STEPS):
    """Submit ``reqs`` (the ones that use adapter ``name`` apart from the others) and wait until every
    one that uses ``name`` has produced its first token. The others are not waited for: an engine may
    run them after those (llama-server batches only requests with equal adapter sets and serves the
    others in turn), and what the change must not disturb is their result, judged at the end."""
    users = engine.submit([r for r in reqs if r.adapter == name])
    others = [r for r in reqs if r.adapter != name]
    beside = engine.submit(others) if others else None
    assert users.wait_started(TIMEOUT), f"submitted requests produced no token within {TIMEOUT} s"
    return Running(list(reqs), name, users, beside, time.monotonic(), steps)


def change_while_running(running, change, what):
    """Run ``change`` (a load / unload of ``running.name``, which ``running.users`` use): it must wait
    for them (module docstring: finished when it returns, up to the delivery of their last answers)
    or refuse with AdapterInUseError (then it is retried once they are done). Returns how it went, or
    None where the requests were done before the change could be issued (nothing was changed: it
    would test nothing; ``change_during`` runs again with longer requests)."""
    users = running.users
    if users.done():
        return None
    try:
        change()
    except AdapterInUseError:
        users.result(TIMEOUT)
        change()
        return "refused"
    returned = time.monotonic()
    if users.done():
        return "waited"
    users.result(TIMEOUT)
    finished = time.monotonic()
    lag = finished - returned
    # A lower bound on their step time: when they had all begun, at most steps - 1 steps were left.
    step = (finished - running.started_at) / (running.steps - 1)
    assert lag <= max(DELIVERY_STEPS * step, DELIVERY_FLOOR_S), (
        f"{what} returned while requests using the adapter were still running: they finished {lag:.3f} s "
        f"later, {lag / step:.1f} of their decode steps ({step * 1e3:.1f} ms each), more than the "
        f"{DELIVERY_STEPS} steps (at least {DELIVERY_FLOOR_S * 1e3:.0f} ms) that the delivery of their last "
        "answers may take; it must wait for them or raise AdapterInUseError")
    return "waited"


def change_during(lora, engine, labels, name, change, what, offset=0):
    """Requests with ``labels`` (those of ``name`` the users) started, and ``change`` issued while they
    run (``change_while_running``); where they were done first, again with the next length of
    ``STEP_LADDER``. Returns (the requests, their Running). Done first at every length: a suite defect."""
    for steps in STEP_LADDER:
        reqs = long_requests(lora, labels, offset, steps)
        running = start(lora, engine, reqs, name, steps)
        if change_while_running(running, change, what) is not None:
            return reqs, running
        running.result(TIMEOUT)  # this attempt changed nothing: drain it, then longer requests
    pytest.fail(f"suite defect: even {STEP_LADDER[-1]}-step requests finished before {what} was issued, so the "
                "change never landed while they ran (this engine needs longer ones)", pytrace=False)


@pytest.mark.feature("inflight_lifecycle/unload_while_requests_run",
                     "unloading an adapter that running requests use waits for them or is refused; they keep its weights",
                     requires=("inflight_lifecycle",))
def test_unload_while_requests_run(lora, device, dtype):
    engine = lora.engine_with()
    lora.load(engine, "X", SPECS["A"])
    running_reqs, running = change_during(lora, engine, ["X", None, "X"], "X", lambda: engine.unload_adapter("X"),
                                          "unload_adapter('X')")
    assert "X" not in engine.list_adapters(), f"X still listed after unload: {engine.list_adapters()}"
    # The slot X used is free now: another adapter moves in and serves at once.
    lora.load(engine, "Y", SPECS["B"])
    after_reqs = long_requests(lora, ["Y", "Y"], offset=3)
    after = engine.submit(after_reqs)
    lora.assert_matches_reference(running.result(TIMEOUT), lora.reference(running_reqs, {"X": SPECS["A"]}),
                                  running_reqs, label="requests running across the unload (X = A)")
    lora.assert_matches_reference(after.result(TIMEOUT), lora.reference(after_reqs, {"Y": SPECS["B"]}),
                                  after_reqs, label="requests after the unload (Y = B)")


@pytest.mark.feature("inflight_lifecycle/reload_while_requests_run",
                     "reloading a name that running requests use never serves them the new weights",
                     requires=("inflight_lifecycle",))
def test_reload_while_requests_run(lora, device, dtype):
    engine = lora.engine_with()
    lora.load(engine, "X", SPECS["A"])
    probe = long_requests(lora, ["X", None, "X"])  # the adapters tell apart (asserted before any change)
    lora.assert_adapter_visible(lora.reference(probe, {"X": SPECS["A"]}), probe, label="X = A vs base",
                                others=lora.reference(probe, {"X": SPECS["B"]}))
    old_reqs, old = change_during(lora, engine, ["X", None, "X"], "X", lambda: lora.load(engine, "X", SPECS["B"]),
                                  "load_adapter('X') over X")
    refs_old = lora.reference(old_reqs, {"X": SPECS["A"]})
    new_reqs = long_requests(lora, ["X", "X"], offset=5)
    new = engine.submit(new_reqs)
    lora.assert_matches_reference(old.result(TIMEOUT), refs_old, old_reqs,
                                  label="requests running across the reload (X = A)")
    lora.assert_matches_reference(new.result(TIMEOUT), lora.reference(new_reqs, {"X": SPECS["B"]}), new_reqs,
                                  label="requests after the reload (X = B)")


@pytest.mark.feature("inflight_lifecycle/concurrent_submissions_match_reference",
                     "requests submitted from several threads, while another adapter loads, match the reference",
                     requires=("inflight_lifecycle",))
def test_concurrent_submissions_match_reference(lora, device, dtype):
    engine = lora.engine_with()
    lora.load(engine, "A", SPECS["A"])
    groups = [long_requests(lora, labels, offset=i) for i, labels in enumerate([["A", None], [None, "A"], ["A"]])]
    handles, errors = [None] * len(groups), []

    def submit(i):
        try:
            handles[i] = engine.submit(groups[i])
        except Exception as exc:  # reported below, with the group
            errors.append((i, exc))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    lora.load(engine, "B", SPECS["B"])  # a new name while the others run
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, f"submit from a thread failed: {errors}"
    late = long_requests(lora, ["B", "A"], offset=7)
    groups.append(late)
    handles.append(engine.submit(late))
    for i, (reqs, handle) in enumerate(zip(groups, handles)):
        lora.assert_matches_reference(handle.result(TIMEOUT), lora.reference(reqs, SPECS), reqs,
                                      label=f"submission {i}")
