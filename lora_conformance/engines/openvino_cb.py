"""``--engine openvino --engine-arg mode=continuous_batching``: GenAI's ``ContinuousBatchingPipeline``
served the way a server serves it, through its request API.

A serving loop (one thread of the plugin's) calls ``ContinuousBatchingPipeline.step()`` while
requests are in flight; every request enters with ``add_request(id, input_ids, config)``, its own
``GenerationConfig`` carrying its own ``adapters`` (``AdapterConfig(adapter, alpha)``, or an empty
``AdapterConfig`` for the base), at once, while other requests run; tokens are read from each
request's ``GenerationHandle`` after every step. ``generate`` is ``submit`` and a wait. So requests
with different adapters, and requests submitted while others decode, share GenAI's continuous
batch; whether GenAI serves each one its own adapter is what the suites judge.

What GenAI does with them (openvino-genai 2026.4.1; source lines from openvino.genai master
da1db864, ``src/cpp/src/continuous_batching/pipeline_impl.cpp``):

* ``add_request`` (lines 292-351) stores the request's ``GenerationConfig`` with its sequence group
  and nothing else reads ``adapters`` from it; ``step`` (378-) runs every scheduled request through
  the one infer request. The LoRA state of that infer request is set only by ``set_adapters``
  (535-538), called only from ``generate`` (575), after ``generate`` has asserted that all its
  requests carry the same ``adapters`` (570-573: "LoRA adapters value must be the same for all
  requests"; 2026.4.1's own message names line 697) and that no request is running (553-555). A
  GenAI pull request says so in words: "Currently it is only done in generate method, so inference
  with lora via add_request is completely ignored"
  (https://github.com/openvinotoolkit/openvino.genai/pull/3677, closed unmerged).
  ``tests/test_engine_openvino_cb.py::test_genai_add_request_ignores_the_request_adapters`` shows it
  with GenAI alone: on a fresh pipeline every request is served as the base model, after a
  ``generate`` with adapter X every request is served with X.
* The plugin does not work around it (it calls no ``generate`` to switch the state, and does not
  group requests by adapter: the default mode does that): the capabilities below are declared
  because GenAI's request API takes them, and the report shows what it serves.

Declared in this mode, besides the default mode's: ``mixed_batch`` (per-request ``adapters`` in one
continuous batch), ``inflight_lifecycle`` (``submit``; an unload or reload of a name that running
requests use waits for them, the interface's rule: GenAI itself would keep serving the request's
own ``Adapter`` object), ``chunked_prefill`` (``SchedulerConfig.dynamic_split_fuse`` with
``max_num_batched_tokens`` = the standard arg ``chunked_prefill_size``; 0 turns the split off).
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lora_conformance.engines.base import EngineFailure, FuturesHandle, RequestHandle
from lora_conformance.types import GenerationRequest, GenerationResult

# GenerationStatus names that end a request without its tokens (GenAI drops a request it cannot
# schedule, for example when the KV cache is exhausted: pipeline_impl.cpp's step(), "we are out of memory").
_DROPPED = ("IGNORED", "CANCEL", "STOP")


@dataclass
class InFlight:
    """One request in GenAI's continuous batch."""

    request_id: int
    index: int  # its position in the submitted list (for messages)
    request: GenerationRequest
    input_ids: Any  # the prompt's token ids (an ov.Tensor of shape [1, n])
    adapter: Optional[str]
    handle: Any  # openvino_genai GenerationHandle
    future: Future
    started: threading.Event
    finish: Callable[["InFlight"], GenerationResult]  # builds the result from what was read
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    beams: list = field(default_factory=list)  # (score, ids) of each returned sequence, beam requests
    beam: bool = False


class ServingLoop:
    """Steps one GenAI ContinuousBatchingPipeline while requests are in flight.

    Every call into the pipeline (``add_request``, ``step``, reading handles) is made under one
    condition lock, so submissions from other threads enter between two steps. ``exclusive()``
    waits until nothing runs and holds new submissions back (a pipeline rebuild)."""

    def __init__(self, pipeline: Callable[[], Any], name: str = "openvino"):
        self._pipeline = pipeline  # the current pipeline (it may be rebuilt between requests)
        self._name = name
        self._cv = threading.Condition()
        self._active: dict[int, InFlight] = {}
        self._ids = itertools.count()
        self._exclusive = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-serving-loop", daemon=True)
        self._thread.start()

    # ---- submitting --------------------------------------------------------------------

    def submit(self, items: Sequence[tuple[GenerationRequest, Any, Any, Optional[str], bool]],
               finish: Callable[[InFlight], GenerationResult]) -> list[InFlight]:
        """``items``: (request, input_ids tensor, GenerationConfig, adapter name, beam?) each. All enter
        the running batch at once; a refusal of any (GenAI raises on add_request) fails the call
        before any of them runs. ``handle(flights)`` makes their RequestHandle."""
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive or self._closed)
            if self._closed:
                raise EngineFailure(f"engine {self._name!r}: the serving loop is closed")
            pipe = self._pipeline()
            added: list[InFlight] = []
            for k, (req, ids, config, adapter, beam) in enumerate(items):
                rid = next(self._ids)
                try:
                    handle = pipe.add_request(rid, ids, config)
                except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError and its own types
                    for f in added:  # already queued ones: GenAI drops them at its next step
                        f.handle.cancel()
                        del self._active[f.request_id]
                    raise EngineFailure(f"engine {self._name!r}: GenAI refused request {k} "
                                        f"(adapter={adapter or 'base'}): {type(exc).__name__}: "
                                        f"{' '.join(str(exc).split())[-400:]}") from exc
                f = InFlight(rid, k, req, ids, adapter, handle, Future(), threading.Event(), finish, beam=beam)
                f.future.set_running_or_notify_cancel()
                self._active[rid] = f
                added.append(f)
            self._cv.notify_all()
        return added

    @staticmethod
    def handle(flights: Sequence[InFlight]) -> RequestHandle:
        return FuturesHandle([f.future for f in flights], [f.started for f in flights])

    # ---- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._active or self._closed)
                if self._closed:
                    self._fail_all("the engine was closed while requests ran")
                    return
                try:
                    self._pipeline().step()
                    self._collect()
                except Exception as exc:  # noqa: BLE001 - a step that raises fails what is in flight
                    self._fail_all(f"GenAI's step() failed: {type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[-400:]}")
                self._cv.notify_all()
            time.sleep(0)  # let a waiting submitter take the lock between steps

    def _collect(self) -> None:
        for rid, f in list(self._active.items()):
            status = f.handle.get_status().name
            if f.beam:
                if status == "FINISHED":
                    f.beams = [(float(o.score), [int(x) for x in o.generated_ids]) for o in f.handle.read_all()]
                    f.started.set()
                    self._settle(f)
            else:
                if f.handle.can_read():
                    for out in f.handle.read().values():
                        f.tokens += [int(x) for x in out.generated_ids]
                        f.logprobs += [float(x) for x in out.generated_log_probs]
                    if f.tokens:
                        f.started.set()
                if status == "FINISHED":
                    self._settle(f)
            if status in _DROPPED:
                del self._active[rid]
                f.started.set()
                f.future.set_exception(EngineFailure(
                    f"engine {self._name!r}: GenAI ended request {f.index} (adapter={f.adapter or 'base'}) "
                    f"with status {status} before it finished (tokens so far: {f.tokens})"))

    def _settle(self, f: InFlight) -> None:
        del self._active[f.request_id]
        try:
            f.future.set_result(f.finish(f))
        except Exception as exc:  # noqa: BLE001 - an inconsistent answer fails that request only
            f.future.set_exception(exc if isinstance(exc, EngineFailure) else EngineFailure(
                f"engine {self._name!r}: request {f.index}: {type(exc).__name__}: {exc}"))

    def _fail_all(self, why: str) -> None:
        for f in self._active.values():
            f.started.set()
            f.future.set_exception(EngineFailure(f"engine {self._name!r}: request {f.index} "
                                                 f"(adapter={f.adapter or 'base'}): {why}"))
        self._active.clear()

    # ---- control ---------------------------------------------------------------------------

    def running(self) -> int:
        with self._cv:
            return len(self._active)

    def exclusive(self, action: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        """Run ``action`` once no request is in flight, holding new submissions back meanwhile."""
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            try:
                if not self._cv.wait_for(lambda: not self._active, timeout=timeout):
                    raise EngineFailure(f"engine {self._name!r}: {len(self._active)} request(s) still ran after "
                                        f"{timeout:g} s; the pipeline cannot be rebuilt under them")
                return action()
            finally:
                self._exclusive = False
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
