"""Measure the tolerance table: how far correct engines drift from the float32 reference, per dtype.

For each engine (default: builtin and peft) and dtype, serve the default prompts with the
base model and each default adapter (one mixed batch), and print the worst prefill and
decode logprob differences, the worst reference gap at a divergence, and the current
TOLERANCES row beside them, with the headroom ratio. A faulty build must exceed them:
tests/test_detection_power.py checks that.

    python bench/calibrate_tolerances.py [--device cpu] [--engines builtin,peft] [--dtypes float32,bfloat16,float16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lora_conformance.adapters import DEFAULT_ADAPTERS, synthesize_cached
from lora_conformance.judge.tolerances import TOLERANCES
from lora_conformance.engines import create_engine
from lora_conformance.models import default_prompts, resolve_base_model
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.settings import default_cache_dir
from lora_conformance.types import GenerationRequest


def common_max(a, b):
    keys = a.keys() & b.keys()
    return max((abs(a[k] - b[k]) for k in keys), default=0.0)


def measure(engine, reference, adapters, prompts, supports_prompt_lp):
    labels = [None] + list(adapters)
    reqs = [GenerationRequest(prompt=p, adapter=l, max_new_tokens=16, prompt_logprobs=supports_prompt_lp)
            for l in labels for p in prompts]
    outs = engine.generate(reqs)
    refs = reference.generate(reqs, adapters)
    worst = {"prefill": 0.0, "decode": 0.0, "divergences": 0, "divergence_gap": 0.0, "steps": 0}
    for out, ref in zip(outs, refs):
        if out.prompt_logprobs and ref.prompt_logprobs:
            for a, r in zip(out.prompt_logprobs, ref.prompt_logprobs):
                worst["prefill"] = max(worst["prefill"], common_max(a, r))
        for step, (at, rt) in enumerate(zip(out.token_ids, ref.token_ids)):
            worst["decode"] = max(worst["decode"], common_max(out.logprobs[step], ref.logprobs[step]))
            worst["steps"] += 1
            if at != rt:
                worst["divergences"] += 1
                gap = ref.logprobs[step][rt] - ref.logprobs[step].get(at, float("-inf"))
                worst["divergence_gap"] = max(worst["divergence_gap"], gap)
                break
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", default="builtin,peft")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--cache", type=Path, default=default_cache_dir())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = resolve_base_model("synthetic:llama", args.cache / "models")
    adapters = {n: synthesize_cached(model, s, args.cache / "adapters") for n, s in DEFAULT_ADAPTERS.items()}
    reference = ReferenceRunner(model, "cpu", "float32", ReferenceCache(args.cache / "references"))
    prompts = default_prompts()
    rows = []
    for engine_name in args.engines.split(","):
        for dtype in args.dtypes.split(","):
            engine = create_engine(engine_name, model, args.device, dtype, {})
            try:
                for name, path in adapters.items():
                    engine.load_adapter(name, path)
                w = measure(engine, reference, adapters, prompts, engine.supports("prompt_logprobs"))
            finally:
                engine.close()
            t = TOLERANCES[dtype]
            rows.append({"engine": engine_name, "dtype": dtype, **w, "prefill_atol": t.free_running_atol,
                         "decode_atol": t.decode_atol, "tie_margin": t.tie_margin})
    head = f"{'engine':<8} {'dtype':<9} {'prefill':>9} {'/atol':>7} {'decode':>9} {'/atol':>7} {'div':>4} {'gap':>8} {'/tie':>7}"
    print(head)
    for r in rows:
        print(f"{r['engine']:<8} {r['dtype']:<9} {r['prefill']:>9.2e} {r['prefill'] / r['prefill_atol']:>7.2f} "
              f"{r['decode']:>9.2e} {r['decode'] / r['decode_atol']:>7.2f} {r['divergences']:>4} "
              f"{r['divergence_gap']:>8.2e} {r['divergence_gap'] / r['tie_margin']:>7.2f}")
    print("(ratios are measured / tolerance: all must stay below 1 on correct engines; prefill: the worst single "
          "prompt point against the gross bound free_running_atol, the pooled prompt rms is bench/power.py's)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
