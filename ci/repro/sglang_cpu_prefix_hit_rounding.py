"""A radix-cache hit in SGLang is not bit-identical to the miss (float32, cpu).

    /work/venv-sglang/bin/python ci/repro/sglang_cpu_prefix_hit_rounding.py

The same batch (an adapter row and a base row) three times on SGLang 0.5.15.post1 offline, with the
radix cache on (SGLang's default) and off (prefix_cache=0), then once more after /flush_cache. Seen on
this 2-core machine: with the cache on, run 2 (7 of 8 prompt tokens cached) differs from run 1 by
3.1e-6 in logprob, run 3 equals run 2, and after the flush the batch equals run 1 again; with the cache
off every run is bit-identical. This is behind the xfail of runtime_modes/repeated_runs_are_identical
and the bit-exact health checks of the bad_input suite (lora_conformance/expectations/sglang-cpu.toml).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def worst(a, b) -> float:
    return max((abs(s[k] - t[k]) for x, y in zip(a, b) for s, t in zip(x.logprobs, y.logprobs) for k in s if k in t),
               default=0.0)


def main() -> int:
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.engines.sglang_engine import SGLangEngine
    from lora_conformance.models import resolve_base_model
    from lora_conformance.types import GenerationRequest

    work = Path(tempfile.mkdtemp(prefix="sglang-prefix-"))
    model = resolve_base_model("synthetic:llama", work / "models")
    adapter = synthesize_adapter(model, AdapterSpec(seed=1), work / "A")
    reqs = [GenerationRequest("the old man walked to the river", "A", 4, 3),
            GenerationRequest("she said that the river was cold", None, 4, 3)]
    for args in ({}, {"prefix_cache": "0"}):
        engine = SGLangEngine(model, "cpu", "float32", args)
        try:
            engine.load_adapter("A", adapter)
            runs = [engine.generate(reqs) for _ in range(3)]
            print(f"{args or 'radix cache on'}: cached tokens per run {[[r.cached_tokens for r in run] for run in runs]}; "
                  f"max |logprob diff| run1-run2 {worst(runs[0], runs[1]):.2e}, run2-run3 {worst(runs[1], runs[2]):.2e}")
            engine.reset_prefix_cache()
            again = engine.generate(reqs)
            print(f"{args or 'radix cache on'}: after flush_cache, max |diff| to run1 {worst(runs[0], again):.2e}")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
