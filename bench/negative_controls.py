"""How far correct implementations spread: each negative control against the default engine and the reference.

The negative controls (``lora_conformance.engines.builtin.variants``: PEFT, and the built-in
engine with a benign ``variant=`` such as factors rescaled or requests one at a time, plus
graphs / Triton kernels where the device has them) all compute the right function; what
separates their outputs is rounding. For each dtype this serves one mixed batch (the base
and each adapter on every prompt, prompt logprobs where the engine gives them) on the
synthetic llama and prints, side by side, the worst |Δ logprob| of each control against the
default built-in engine and against the float32 HF+PEFT reference, prefill and decode apart
(decode compared up to a sequence's first token divergence, divergences counted), next to the
tolerance table's row. A verdict must pass every row; the spread calibrates how close a
correct engine can be required to stay.

    python bench/negative_controls.py [--device cpu] [--dtypes float32,bfloat16] [--prompts 6]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lora_conformance.adapters import DEFAULT_ADAPTERS, AdapterSpec, synthesize_cached
from lora_conformance.judge.tolerances import TOLERANCES
from lora_conformance.engines import create_engine
from lora_conformance.engines.builtin.variants import negative_controls
from lora_conformance.models import default_prompts, resolve_base_model
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.settings import default_cache_dir
from lora_conformance.types import GenerationRequest

# The default q/v adapters (scaling 2 and 1) plus one on every linear module with scaling 3: a
# scaling that is not a power of two, so variant preround rounds differently somewhere.
ADAPTERS = {**DEFAULT_ADAPTERS, "L": AdapterSpec(seed=951, targets="all-linear", alpha=24)}


def _common_max(a: dict, b: dict) -> float:
    return max((abs(a[k] - b[k]) for k in a.keys() & b.keys()), default=0.0)


def spread(outs, others) -> dict:
    """Worst |Δ logprob| of outs against others: prefill positions, decode steps up to the first divergence."""
    w = {"prefill": 0.0, "decode": 0.0, "divergences": 0}
    for out, other in zip(outs, others):
        for a, b in zip(out.prompt_logprobs or [], other.prompt_logprobs or []):
            w["prefill"] = max(w["prefill"], _common_max(a, b))
        for step, (x, y) in enumerate(zip(out.token_ids, other.token_ids)):
            w["decode"] = max(w["decode"], _common_max(out.logprobs[step], other.logprobs[step]))
            if x != y:
                w["divergences"] += 1
                break
    return w


def serve(engine_name: str, args: dict, model, device: str, dtype: str, adapters: dict, requests) -> list:
    engine = create_engine(engine_name, model, device, dtype, args)
    try:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        wants_prompt = engine.supports("prompt_logprobs")
        reqs = [GenerationRequest(r.prompt, r.adapter, r.max_new_tokens, top_k=r.top_k,
                                  prompt_logprobs=r.prompt_logprobs and wants_prompt) for r in requests]
        return engine.generate(reqs)
    finally:
        engine.close()


def label_of(args: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in args.items()) or "builtin (default)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=6, help="how many of the default prompts")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--cache", type=Path, default=default_cache_dir())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = resolve_base_model("synthetic:llama", args.cache / "models")
    adapters = {n: synthesize_cached(model, s, args.cache / "adapters") for n, s in ADAPTERS.items()}
    reference = ReferenceRunner(model, "cpu", "float32", ReferenceCache(args.cache / "references"))
    prompts = default_prompts()[: args.prompts]
    requests = [GenerationRequest(p, label, args.new_tokens, top_k=5, prompt_logprobs=True)
                for label in [None, *adapters] for p in prompts]
    refs = reference.generate(requests, adapters)
    controls = negative_controls(args.device)  # the first, {}, is the default engine itself
    rows = []
    for dtype in args.dtypes.split(","):
        default = None
        for control in controls:
            engine_args = {k: v for k, v in control.items() if k != "engine"}
            outs = serve(control.get("engine", "builtin"), engine_args, model, args.device, dtype, adapters, requests)
            default = default or outs
            vs_default, vs_ref = spread(outs, default), spread(outs, refs)
            rows.append({"control": label_of(control), "dtype": dtype, "requests": len(requests),
                         **{f"{k}_vs_default": v for k, v in vs_default.items()},
                         **{f"{k}_vs_reference": v for k, v in vs_ref.items()}})
    print(f"synthetic:llama, {len(prompts)} prompts x (base + {', '.join(adapters)}), {args.new_tokens} new tokens, "
          f"device {args.device}; max |Δ logprob| (prefill / decode up to a divergence) and divergences")
    head = (f"{'control':<24} {'dtype':<9} | {'vs default: prefill':>19} {'decode':>9} {'div':>4} "
            f"| {'vs reference: prefill':>21} {'decode':>9} {'div':>4} | {'gross: prefill':>14} {'decode':>7}")
    print(head)
    for r in rows:
        t = TOLERANCES[r["dtype"]]
        print(f"{r['control']:<24} {r['dtype']:<9} | {r['prefill_vs_default']:>19.2e} {r['decode_vs_default']:>9.2e} "
              f"{r['divergences_vs_default']:>4} | {r['prefill_vs_reference']:>21.2e} {r['decode_vs_reference']:>9.2e} "
              f"{r['divergences_vs_reference']:>4} | {t.free_running_atol:>14.2g} {t.decode_atol:>7.2g}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
