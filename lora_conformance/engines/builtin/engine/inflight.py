"""Concurrent serving: requests submitted from any thread, adapters loaded and unloaded while they run.

One condition variable guards the serving state (scheduler, adapter pool, model runner): a step,
an adapter registration and an admission never interleave, so no batch is torn mid-step.
Requests are stepped by a background loop (``submit``) or by the calling thread (``generate``);
both take the lock one step at a time.

Lifecycle rule: a request is served entirely by the adapter weights registered when it was
submitted. Replacing or unloading a name therefore *drains* it first: new requests for the
name wait at the gate, and the load / unload waits until no queued or running request uses it.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence as Seq

from lora_conformance.engines.base import EngineFailure, RequestHandle
from lora_conformance.engines.builtin.engine.llm_engine import LLMEngine
from lora_conformance.engines.builtin.engine.sequence import Sequence, Status
from lora_conformance.types import GenerationRequest, GenerationResult


class InflightServer:
    def __init__(self, llm: LLMEngine, faults):
        self.llm, self.faults = llm, faults
        self.cond = threading.Condition()
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

    def generate(self, requests: Seq[GenerationRequest]) -> list[GenerationResult]:
        with self.cond:
            seqs = self._add(requests)
        while True:
            with self.cond:
                if _finished(seqs):
                    return self.llm.results(seqs)
                ran = self.llm.step()
                self.cond.notify_all()
                if not ran and not _finished(seqs):
                    raise EngineFailure("engine 'builtin': requests left unscheduled with nothing to run")

    def submit(self, requests: Seq[GenerationRequest]) -> "BuiltinHandle":
        with self.cond:
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
        with self.cond:
            if self.faults.on("inflight_no_drain"):
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
        with self.cond:
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
        with self.server.cond:
            return _finished(self.seqs)

    def wait_started(self, timeout: float) -> bool:
        started = lambda: all(s.output_ids or s.status is Status.FINISHED for s in self.seqs)  # noqa: E731
        with self.server.cond:
            return self.server.cond.wait_for(lambda: self.server.failure is not None or started(), timeout)

    def result(self, timeout: float) -> list[GenerationResult]:
        srv = self.server
        with srv.cond:
            if not srv.cond.wait_for(lambda: srv.failure is not None or srv._closed or _finished(self.seqs), timeout):
                raise EngineFailure(f"engine 'builtin': {len(self.seqs)} submitted requests not done after {timeout} s")
            if not _finished(self.seqs):
                raise EngineFailure(f"engine 'builtin' stopped before these requests finished: {srv.failure!r}")
            return srv.llm.results(self.seqs)
