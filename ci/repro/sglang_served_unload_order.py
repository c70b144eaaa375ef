"""When SGLang's served unload answers, relative to the requests that use the adapter (cpu).

    /work/venv-sglang/bin/python ci/repro/sglang_served_unload_order.py [TRIALS] [DTYPE]

SGLang 0.5.15.post1 served (``--engine-arg mode=served``): adapter X loaded, two streamed requests of 48
steps on X and one base request beside them (each its own HTTP request, as the plugin's ``submit``
sends them), then ``POST /unload_lora_adapter`` once every request has its first token. SGLang unregisters
X, waits until no request holds it (srt/lora/lora_registry.py:186-202; a request releases it when its
final output reaches the tokenizer manager, srt/managers/tokenizer_manager.py:2106-2116), then unloads it
in the scheduler and answers. The base request holds nothing and is not waited for.

Printed per trial, in ms after the unload's answer reached this process (negative: before it): when each
X request's stream and the base request's stream were done here, and how long one decode step took. What
the suites judge (suites/test_inflight_lifecycle.py): the X requests done when the change returns, or
within DELIVERY_STEPS of their steps after it (two answers on two connections arrive in either order);
the base request is not judged by the change's timing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

STEPS = 48


def main() -> int:
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.engines.sglang_engine import SGLangEngine
    from lora_conformance.models import default_prompts, resolve_base_model
    from lora_conformance.types import GenerationRequest

    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    work = Path(tempfile.mkdtemp(prefix="sglang-unload-order-"))
    model = resolve_base_model("synthetic:llama", work / "models")
    adapter = synthesize_adapter(model, AdapterSpec(seed=9), work / "X")
    prompts = default_prompts()
    engine = SGLangEngine(model, "cpu", dtype, {"mode": "served"})
    worst = []
    try:
        for trial in range(trials):
            engine.load_adapter("X", adapter)
            users = [GenerationRequest(prompts[(trial + i) % len(prompts)], "X", STEPS) for i in (0, 2)]
            beside = [GenerationRequest(prompts[(trial + 1) % len(prompts)], None, STEPS)]
            done_at: dict[str, float] = {}
            handles = {"X": engine.submit(users), "base": engine.submit(beside)}
            for label, handle in handles.items():
                for i, future in enumerate(handle._futures):
                    future.add_done_callback(lambda _f, k=f"{label}[{i}]": done_at.setdefault(k, time.monotonic()))
            for handle in handles.values():
                assert handle.wait_started(300)
            started = time.monotonic()
            engine.unload_adapter("X")
            returned = time.monotonic()
            for handle in handles.values():
                handle.result(300)
            finished = max(done_at.values())
            step = (finished - started) / (STEPS - 1)
            rel = {k: round((t - returned) * 1e3, 1) for k, t in sorted(done_at.items())}
            worst.append(max(v for k, v in rel.items() if k.startswith("X")) / (step * 1e3))
            print(f"trial {trial}: unload took {(returned - started) * 1e3:.0f} ms; done here, ms after its answer: "
                  f"{rel}; one step {step * 1e3:.1f} ms", flush=True)
    finally:
        engine.close()
    print(f"latest X request after the unload's answer, in steps: {[round(w, 2) for w in worst]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
