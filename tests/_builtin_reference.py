"""HF transformers + PEFT reference runs for the built-in engine's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Per-dtype tolerance on logprobs (one table, not literals in tests).
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 0.15}


def peft_model(base: Path, adapters: dict[str, Path], dtype: str = "float32"):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(base), dtype=DTYPES[dtype]).eval()
    if not adapters:
        return m
    items = list(adapters.items())
    pm = PeftModel.from_pretrained(m, str(items[0][1]), adapter_name=items[0][0])
    for n, p in items[1:]:
        pm.load_adapter(str(p), adapter_name=n)
    return pm.eval()


@torch.no_grad()
def reference_generate(model, tok, prompts: list[str], names: Optional[list[str]], max_new_tokens: int):
    """Greedy tokens and per-step full log-softmax (float32) for each prompt, in one HF batch."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = {"adapter_names": names} if names is not None else {}
    model.generation_config.eos_token_id = None  # the engine is asked to ignore EOS as well
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id, **kw)
    toks = out.sequences[:, enc["input_ids"].shape[1]:].tolist()
    lps = [[torch.log_softmax(step[i].float(), -1) for step in out.logits] for i in range(len(prompts))]
    return toks, lps


@torch.no_grad()
def reference_prompt_logprobs(model, tok, prompt: str, adapter: Optional[str]):
    """log-softmax of the distribution predicting each prompt position i > 0."""
    enc = tok([prompt], return_tensors="pt")
    kw = {"adapter_names": [adapter or "__base__"]} if adapter is not None or hasattr(model, "peft_config") else {}
    logits = model(**enc, **kw).logits[0].float()
    return torch.log_softmax(logits[:-1], -1)


def max_topk_error(engine_topk: dict[int, float], ref_lp: torch.Tensor) -> float:
    return max(abs(v - ref_lp[t].item()) for t, v in engine_topk.items())
