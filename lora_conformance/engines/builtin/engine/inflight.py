"""Concurrent serving: requests submitted from any thread, adapters loaded and unloaded while they run.

One condition variable guards the serving state (scheduler, adapter pool, model runner): a step,
an adapter registration and an admission never interleave, so no batch is torn mid-step.
Requests are stepped by a background loop (``submit``) or by the calling thread (``generate``);
both take the lock one step at a time. A turnstile keeps that fair: a thread that wants the lock
for anything else (an admission, an adapter change) holds the turnstile while it waits, and the
loop passes the turnstile before each step, so the change gets in at the next step boundary
instead of only when the loop runs dry (without it, a fast device's loop re-takes the lock first
every time, and a change waits for every running request whether it should or not).

Lifecycle rule: a request is served entirely by the adapter weights registered when it was
submitted. Replacing or unloading a name therefore *drains* it first: new requests for the
name wait at the gate, and the load / unload waits until no queued or running request uses it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence as Seq

from lora_conformance.engines.base import EngineFailure, RequestHandle
from lora_conformance.engines.builtin.engine.llm_engine import LLMEngine
from lora_conformance.engines.builtin.engine.sequence import Sequence, Status
from lora_conformance.types import GenerationRequest, GenerationResult


class InflightServer:
    def __init__(self, llm: LLMEngine, drain: bool = True):
        self.llm, self.drain = llm, drain  # drain False only under fault inflight_no_drain
        self.cond = threading.Condition()
        self._turn = threading.Lock()  # the turnstile (module docstring)
        self._draining: set[str] = set()
        self._loop: threading.Thread | None = None
        self._closed = False
        self.failure: BaseException | None = None  # what broke the background loop

    # ---- requests ----------------------------------------------------------------------
    def _add(self, requests: Seq[GenerationRequest]) -> list[Sequence]:
        """Queue ``requests`` (lock held); waits while one of their adapters is being replaced."""
        names = {r.adapter for r in requests if r.adapter is not None}
        self.cond.wait_for(lambda: not names & self._draining)
        return self.llm.add(requests)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, taken at the next step boundary (through the turnstile)."""
        with self._turn:
            self.cond.acquire()
        try:
            yield
        finally:
            self.cond.release()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Until ``predicate`` (checked under the lock at step boundaries) holds, or ``timeout``.
        It polls through the turnstile rather than ``cond.wait``: a thread woken from a condition
        re-takes the lock in a race the stepping loop wins every time."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            with self._locked():
                if predicate():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    def generate(self, requests: Seq[GenerationRequest]) -> list[GenerationResult]:
        with self._locked():
            seqs = self._add(requests)
        while True:
            with self._turn:  # as the background loop: a waiting thread goes first
                pass
            with self.cond:
                if _finished(seqs):
                    return self.llm.results(seqs)
                try:
                    ran = self.llm.step()
                except BaseException as exc:
                    # its requests stay scheduled: waits for them (an adapter change) must end
                    self.failure = exc
                    raise
                finally:
                    self.cond.notify_all()
                if not ran and not _finished(seqs):
                    raise EngineFailure("engine 'builtin': requests left unscheduled with nothing to run")

    def submit(self, requests: Seq[GenerationRequest]) -> "BuiltinHandle":
        with self._locked():
            if self._closed:
                raise EngineFailure("engine 'builtin' is closed")
            seqs = self._add(requests)
            if self._loop is None:
                self._loop = threading.Thread(target=self._serve, name="builtin-engine-loop", daemon=True)
                self._loop.start()
            self.cond.notify_all()
        return BuiltinHandle(self, seqs)

    def _serve(self) -> None:
        while True:
            with self._turn:  # a thread waiting for the lock goes first
                pass
            with self.cond:
                self.cond.wait_for(lambda: self._closed or self.llm.scheduler.has_work())
                if self._closed:
                    return
                try:
                    self.llm.step()
                except BaseException as exc:  # the handles report it; the loop stops
                    self.failure = exc
                    self._closed = True
                    return
                finally:
                    self.cond.notify_all()

    # ---- adapters ------------------------------------------------------------------------
    def change_adapter(self, name: str, change: Callable[[], None]) -> None:
        """Run ``change`` (register / unregister ``name``) once no request uses the name."""
        with self._locked():
            if not self.drain:
                change()
                return
            self.cond.wait_for(lambda: name not in self._draining)
            self._draining.add(name)
            try:
                self.cond.wait_for(lambda: self.failure is not None or not self.llm.in_use(name))
                change()
            finally:
                self._draining.discard(name)
                self.cond.notify_all()

    def close(self) -> None:
        with self._locked():
            self._closed = True
            self.cond.notify_all()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=60)


def _finished(seqs: list[Sequence]) -> bool:
    return all(s.status is Status.FINISHED for s in seqs)


class BuiltinHandle(RequestHandle):
    def __init__(self, server: InflightServer, seqs: list[Sequence]):
        self.server, self.seqs = server, seqs

    def done(self) -> bool:
        with self.server._locked():
            return _finished(self.seqs)

    def wait_started(self, timeout: float) -> bool:
        started = lambda: all(s.output_ids or s.status is Status.FINISHED for s in self.seqs)  # noqa: E731
        return self.server.wait(lambda: self.server.failure is not None or started(), timeout)

    def result(self, timeout: float) -> list[GenerationResult]:
        srv = self.server
        if not srv.wait(lambda: srv.failure is not None or srv._closed or _finished(self.seqs), timeout):
            raise EngineFailure(f"engine 'builtin': {len(self.seqs)} submitted requests not done after {timeout} s")
        with srv._locked():
            if not _finished(self.seqs):
                raise EngineFailure(f"engine 'builtin' stopped before these requests finished: {srv.failure!r}")
            return srv.llm.results(self.seqs)
