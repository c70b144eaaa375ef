"""Two llama-server findings of docs/llamacpp.md ("Served mode"), on a tiny llama with two adapters.

    python ci/repro/llama_server_lora_findings.py cache_ram [ROUNDS]   # default 15 rounds
    python ci/repro/llama_server_lora_findings.py batching [ROUNDS]    # default 8 rounds

cache_ram: each round serves a mixed batch (base and two adapters on three prompts) and, on
threads, three requests of one adapter while another adapter loads (a server restart). With the
host prompt cache on (--cache-ram 8192, llama-server's default) some rows differ from the
single-adapter PeftModel oracle, each with cached tokens > 0; with it off (0), none do.
batching: the same mixed batch re-run on one server: rows whose logprobs are not bit-identical to
the first run, with --parallel 4, --no-kv-unified and --parallel 1 (prefix cache off in all).
Needs llama-server (ci/install_llama_server.sh).
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def setup(work: Path):
    from _tiny_models import build_adapter, build_llama, greedy_oracle

    base = build_llama(work / "llama")
    adapters = {"all": build_adapter(base, work / "all", seed=1),
                "rs": build_adapter(base, work / "rs", seed=2, r=4, alpha=8, use_rslora=True,
                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}
    prompts = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
    oracle = {(a, p): greedy_oracle(base, adapters.get(a), p, 4)[1] for a in (None, *adapters) for p in prompts}
    return base, adapters, prompts, oracle


def start(base, adapters, work, **args):
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine

    e = LlamaCppEngine(base, "cpu", "float32", {"mode": "served", "gguf_cache": str(work / "gguf"),
                                                **{k: str(v) for k, v in args.items()}})
    for name, path in adapters.items():
        e.load_adapter(name, path)
    return e


def cache_ram(rounds: int) -> None:
    from lora_conformance.types import GenerationRequest as G

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base, adapters, prompts, oracle = setup(work)
        for mib in (8192, 0):
            e = start(base, adapters, work, cache_ram=mib)
            wrong, total = 0, 0
            for _ in range(rounds):
                labels = [None, "all", "rs", "all", None, "rs"]
                reqs = [G(prompts[i % 3], adapter=a, max_new_tokens=4, top_k=2) for i, a in enumerate(labels)]
                outs = e.generate(reqs)
                more = [G(p, adapter="all", max_new_tokens=4, top_k=2) for p in prompts]
                handle = e.submit(more)
                loader = threading.Thread(target=e.load_adapter, args=("late", adapters["rs"]))
                loader.start()
                outs += handle.result(120)
                loader.join()
                e.unload_adapter("late")
                for r, o in zip(reqs + more, outs):
                    total += 1
                    if o.token_ids != oracle[(r.adapter, r.prompt)]:
                        wrong += 1
                        print(f"  --cache-ram {mib}: {r.adapter or 'base'} / {r.prompt!r}: {o.token_ids}, oracle "
                              f"{oracle[(r.adapter, r.prompt)]}, cached tokens {o.cached_tokens}")
            e.close()
            print(f"--cache-ram {mib}: {wrong} of {total} requests differ from the oracle")


def batching(rounds: int) -> None:
    from lora_conformance.types import GenerationRequest as G

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base, adapters, prompts, _ = setup(work)
        for args in ({"parallel": 4}, {"parallel": 4, "kv_unified": 0}, {"parallel": 1}):
            e = start(base, adapters, work, prefix_cache=0, **args)
            labels = [None, "all", "rs", "all", None, "rs"]
            reqs = [G(prompts[i % 3], adapter=a, max_new_tokens=6, top_k=3) for i, a in enumerate(labels)]
            first = [o.logprobs for o in e.generate(reqs)]
            differ, total = 0, 0
            for i in range(rounds):
                part = reqs if i % 2 else reqs[:3]
                out = e.generate(part)
                total += len(part)
                differ += sum(o.logprobs != f for o, f in zip(out, first))
            e.close()
            print(f"{args}: {differ} of {total} re-run rows not bit-identical to the first run")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "cache_ram"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else (15 if what == "cache_ram" else 8)
    {"cache_ram": cache_ram, "batching": batching}[what](rounds)
