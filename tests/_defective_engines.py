"""Correct built-in engines with one narrow defect each, for tests/test_blast_radius.py.

Each class is the built-in engine (which passes every suite) with exactly one thing wrong,
the kind of bug a real engine ships with. Run a suite against one with
``--engine=_defective_engines:ClassName`` (this folder is on ``sys.path`` in the tests).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from lora_conformance.engines.base import AdapterIncompatibleError, EngineFailure, UnsupportedFeatureError
from lora_conformance.engines.builtin import BuiltinEngine


class PromptLogprobsFail(BuiltinEngine):
    """Declares prompt_logprobs, but any request that asks for them kills the engine (as vLLM's
    engine core died with LoRA, vllm#16668)."""

    def generate(self, requests):
        if any(r.prompt_logprobs for r in requests):
            raise EngineFailure("engine core died: prompt logprobs requested")
        return super().generate(requests)


class RankOneRefused(BuiltinEngine):
    """Refuses rank-1 adapters (every other rank is served right)."""

    def load_adapter(self, name, path, pinned=False):
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        if config.get("r") == 1:
            raise AdapterIncompatibleError(f"adapter {name!r}: rank 1 is not supported")
        super().load_adapter(name, path, pinned)


class EmbeddingsRefused(BuiltinEngine):
    """Declares embeddings (on an encoder) but refuses every embed() call."""

    def embed(self, texts, adapter=None):
        raise UnsupportedFeatureError("embeddings are not implemented")


class EvictionPolicyIgnored(BuiltinEngine):
    """Declares eviction_lru and eviction_fifo, but ignores the ``eviction`` engine arg: always lru."""

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, {**args, "eviction": "lru"})
        self.args = dict(args)  # what it was asked for; the pool runs lru whatever it says


class DeliveredLate(BuiltinEngine):
    """Not a defect: the built-in engine as a caller behind a connection sees it. Submitted requests
    are drained by adapter changes as the built-in engine drains them, but each handle learns that its
    requests finished half a step of theirs later (their last answers in transit), so a change
    can return before the handle is done: the in-flight suites must pass it (a served engine's unload
    answer and the requests' last answers travel on connections of their own)."""

    def submit(self, requests):
        return _LateHandle(super().submit(requests))


class _LateHandle:
    def __init__(self, inner):
        self._inner, self._delivered = inner, threading.Event()
        self._outcome: tuple = ()
        began = time.monotonic()

        def deliver():
            try:
                results = inner.result(300)
                steps = max(seq.max_new_tokens for seq in inner.seqs)
                time.sleep(0.5 * (time.monotonic() - began) / steps)
                self._outcome = (results, None)
            except BaseException as exc:  # noqa: BLE001 - handed to result()
                self._outcome = (None, exc)
            self._delivered.set()

        threading.Thread(target=deliver, daemon=True).start()

    def done(self):
        return self._delivered.is_set()

    def wait_started(self, timeout):
        return self._inner.wait_started(timeout)

    def result(self, timeout):
        if not self._delivered.wait(timeout):
            raise EngineFailure(f"requests not delivered within {timeout} s")
        results, error = self._outcome
        if error is not None:
            raise error
        return results

