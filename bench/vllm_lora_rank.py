"""What vLLM's ``max_lora_rank`` costs on cpu: one batch of one-token requests, without an adapter and
with one, on engines started with each ``max_lora_rank``, side by side in one run.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_lora_rank.py            # ranks 16 and 64
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_lora_rank.py --ranks 16,32,64 --repeat 5

vLLM's CPU LoRA kernels (``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink``/``bgmv_expand``)
gather every token's A and B, padded to ``max_lora_rank``, before a per-token product, so a batch's
LoRA cost grows with the engine's limit, not with the adapter's rank (default adapter A is rank 8).
The suites' paired checks send such batches (8 contexts per row, one token each) in nearly every
test. The engines are all started first and take turns batch by batch; each row: the median of
``--repeat`` timed batches after one untimed one, and the ratio to the first rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _engines(ranks: list[int]):
    """One engine per max_lora_rank, adapter A loaded in each, all alive at once."""
    from lora_conformance.adapters import DEFAULT_ADAPTERS, synthesize_cached
    from lora_conformance.engines import registry
    from lora_conformance.models import resolve_base_model
    from lora_conformance.settings import default_cache_dir

    cache = default_cache_dir()
    model = resolve_base_model("synthetic:llama", cache)
    adapter = synthesize_cached(model, DEFAULT_ADAPTERS["A"], cache / "adapters")
    engines = {}
    for r in ranks:
        engines[r] = registry.create_engine("vllm", model, "cpu", "float32", {"max_lora_rank": str(r)})
        engines[r].load_adapter("A", adapter)
    return engines


def _time_batches(engines: dict, n: int, repeat: int) -> dict:
    """Median seconds per batch, per (rank, adapter): the engines take turns batch by batch, so a
    slow spell of the machine hits every rank alike."""
    from lora_conformance.models import default_prompts
    from lora_conformance.types import GenerationRequest

    prompts = default_prompts()
    reqs = {a: [GenerationRequest(prompts[i % len(prompts)], a, 1, 20) for i in range(n)] for a in (None, "A")}
    for engine in engines.values():  # untimed: first calls
        for batch in reqs.values():
            engine.generate(batch)
    times: dict = {(r, a or "base"): [] for r in engines for a in reqs}
    for _ in range(repeat):
        for r, engine in engines.items():
            for a, batch in reqs.items():
                t = time.perf_counter()
                engine.generate(batch)
                times[(r, a or "base")].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="16,64", help="max_lora_rank values, comma-separated (first: the baseline)")
    ap.add_argument("--requests", type=int, default=32, help="one-token requests per batch")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ranks = [int(r) for r in a.ranks.split(",")]
    engines = _engines(ranks)
    try:
        t = _time_batches(engines, a.requests, a.repeat)
    finally:
        for engine in engines.values():
            engine.close()
    rows = {r: {"base": t[(r, "base")], "A": t[(r, "A")]} for r in ranks}
    base = rows[ranks[0]]
    print(f"vLLM cpu, {a.requests} one-token requests per batch, top-20 logprobs, median of {a.repeat}")
    print(f"{'max_lora_rank':>13}  {'base ms':>8}  {'adapter A ms':>12}  {'A vs base':>9}  {'A vs rank ' + str(ranks[0]):>14}")
    for r in ranks:
        t = rows[r]
        print(f"{r:>13}  {t['base'] * 1e3:8.0f}  {t['A'] * 1e3:12.0f}  {t['A'] / t['base']:8.1f}x  "
              f"{t['A'] / base['A']:13.2f}x")


if __name__ == "__main__":
    main()
