"""The reference runner passes the KV cache through transformers' current argument (``cache``), not
the deprecated ``past_key_values`` (removed in transformers 5.40), and its references are
bit-identical to the deprecated path's on the synthetic models."""

from __future__ import annotations

import warnings

import pytest

from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.models import resolve_base_model
from lora_conformance.reference import ReferenceRunner
from lora_conformance.reference.runner import kv_cache_argument
from lora_conformance.types import GenerationRequest

PROMPTS = ["the old man", "once upon a time there was a dragon who"]
DEPRECATED = r".*past_key_values.*"


def _legacy_decode(model, tokenizer, prompt: str, steps: int):
    """The runner's decode loop as it was, with ``past_key_values`` (greedy; logprob rows of each step)."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    rows = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        for _ in range(steps):
            rows.append(lp)
            nxt = int(lp.argmax())
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    return rows


@pytest.mark.parametrize("kind, targets", [("llama", "qv"), ("moe", "attention"), ("qwen2", "all-linear")])
def test_references_use_the_current_cache_argument_and_are_bit_identical(kind, targets, lora_settings):
    model_dir = resolve_base_model(f"synthetic:{kind}", lora_settings.cache_dir / "models")
    adapter = synthesize_cached(model_dir, AdapterSpec(targets=targets, seed=5), lora_settings.cache_dir / "adapters")
    runner = ReferenceRunner(model_dir)  # no cache: every reference is computed here
    requests = [GenerationRequest(p, adapter=a, max_new_tokens=6, ignore_eos=True) for p in PROMPTS for a in (None, "A")]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DEPRECATED)  # the deprecated argument would fail this call
        results = runner.generate(requests, {"A": adapter})
    model = runner._model_for(adapter)
    if kv_cache_argument(model) == "past_key_values":
        pytest.skip("this transformers takes only past_key_values: the runner's path is the legacy one")
    for req, res in zip(requests, results):
        model = runner._model_for(adapter if req.adapter else None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rows = _legacy_decode(model, runner.tokenizer, req.prompt, len(res.token_ids))
        assert any("past_key_values" in str(w.message) for w in seen), "the legacy path no longer warns: update this test"
        assert res.token_ids == [int(r.argmax()) for r in rows]
        for step, (topk, row) in enumerate(zip(res.logprobs, rows)):
            assert topk == {i: float(row[i]) for i in topk}, f"{kind} {req.adapter} step {step}: not bit-identical"
