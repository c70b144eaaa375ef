"""Print greedy-stability numbers for a synthetic base model and its default adapters.

    python bench/model_margins.py [--base synthetic:llama] [--steps 16] [--scan N]

For the base model and each default adapter: fp32 top-1/top-2 margin quantiles over the
default prompts x steps, prompts whose bf16 / fp16 greedy output differs from fp32, and
(for adapters) the first step where the output differs from the base. ``--scan N`` tries
seeds 1..N for a q/v rank-8 adapter, to pick DEFAULT_ADAPTERS.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from lora_conformance.adapters import DEFAULT_ADAPTERS, MIN_MARGIN, AdapterSpec, synthesize_cached
from lora_conformance.models import default_prompts, load_model, resolve_base_model
from lora_conformance.models.calibration import diverged, first_change, greedy, peft_with_adapter


def measure(model, tok, prompts, steps, base_tokens=None) -> dict:
    f32 = greedy(model, tok, prompts, steps)
    row = {
        "margins": f32.margins,
        "bf16_div": diverged(f32.tokens, greedy(model, tok, prompts, steps, torch.bfloat16).tokens),
        "fp16_div": diverged(f32.tokens, greedy(model, tok, prompts, steps, torch.float16).tokens),
        "tokens": f32.tokens,
    }
    if base_tokens is not None:
        row["first_change"] = first_change(base_tokens, f32.tokens)
    return row


def show(name: str, row: dict) -> None:
    q = torch.quantile(row["margins"].flatten(), torch.tensor([0.0, 0.01, 0.1, 0.5])).tolist()
    line = f"{name:10s} margin min {q[0]:.3f} p1 {q[1]:.3f} p10 {q[2]:.3f} median {q[3]:.3f}"
    line += f" | bf16 diverged {len(row['bf16_div'])} fp16 diverged {len(row['fp16_div'])}"
    if "first_change" in row:
        fc = row["first_change"]
        line += f" | changed by step 4: {sum(f < 4 for f in fc)}/{len(fc)} (first change {fc})"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="synthetic:llama")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--scan", type=int, default=0)
    ap.add_argument("--cache", default=None)
    args = ap.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="lc-margins-"))
    base = resolve_base_model(args.base, cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    prompts = default_prompts()
    model = load_model(base)
    base_row = measure(model, tok, prompts, args.steps)
    show("base", base_row)
    specs = dict(DEFAULT_ADAPTERS)
    if args.scan:
        specs = {f"seed{s}": AdapterSpec(seed=s) for s in range(1, args.scan + 1)}
    for name, spec in specs.items():
        row = measure(peft_with_adapter(base, synthesize_cached(base, spec, cache)), tok, prompts, args.steps,
                      base_row["tokens"])
        ok = row["margins"].min() >= MIN_MARGIN and not row["bf16_div"] and not row["fp16_div"]
        show(name + (" ok" if ok else ""), row)


if __name__ == "__main__":
    main()
