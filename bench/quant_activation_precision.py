"""Where a quantised-base engine's extra noise comes from: its kernels' activation precision.

llama.cpp's CPU dot products for Q8_0 weights quantise the activation row to Q8_0 (blocks of 32,
float16 scale), for Q4_K to Q8_K (blocks of 256, float32 scale); the LoRA matmuls stay float32.
This script compares, on the snapped base (models/quant.py) and the default adapters' teacher-forced
contexts, the adapter effect (adapter minus base logprobs, on the top-20 tokens of each side) of

* R: the reference, HF + PEFT on the dequantised base (what the suites compare with),
* Rq: the same model with ggml's activation quantisation emulated in front of every quantised base
  linear (not in front of the LoRA factors; engines/builtin/layers/gguf_base.py's quantisers, which the
  built-in and PEFT engines use with ``activations=int8``), and
* L: llama.cpp (the engine plugin, float32 weights elsewhere, extra_bufts off),

and prints the residual rms of each pair. If L sits near Rq and both sit as far from R as
L does, the residual the float32 certification sees is the kernels' activation precision, not
LoRA semantics.

    PYTHONPATH=. python bench/quant_activation_precision.py q8_0 [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import numpy as np
import torch


@contextlib.contextmanager
def quantised_activations(model, scheme: str):
    """Every quantised base linear (decoder layers' *_proj, PEFT's base_layer where wrapped) reads
    its input through ggml's activation quantisation; LoRA factors read it as it is."""
    from lora_conformance.engines.builtin.layers.gguf_base import quantizer
    from lora_conformance.models.quant import GGUF_ACTIVATIONS

    fn = quantizer(GGUF_ACTIVATIONS[scheme])  # ggml's Q8_0 / Q8_K blocks, as the engines emulate them
    hooks = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or ".layers." not in name or "lora_" in name:
            continue
        if not (name.endswith("_proj") or name.endswith("_proj.base_layer")):
            continue
        hooks.append(mod.register_forward_pre_hook(lambda m, args: (fn(args[0]),) + tuple(args[1:])))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scheme", choices=("q8_0", "q4_k"))
    ap.add_argument("--cache", default="/tmp/quant-cache")
    ap.add_argument("--adapters", default="A,B,C,D")
    a = ap.parse_args()
    from lora_conformance.adapters import DEFAULT_ADAPTERS, synthesize_cached
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine
    from lora_conformance.models import default_prompts, resolve_base_model
    from lora_conformance.models.quant import snapped_checkpoint
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    cache = Path(a.cache)
    model = snapped_checkpoint(resolve_base_model("synthetic:llama", cache / "models"), a.scheme,
                               cache / "models" / "quantized")
    ref = ReferenceRunner(model, "cpu", "float32")  # no disk cache: the hooks change its answers
    eng = LlamaCppEngine(model, "cpu", "float32", {"extra_bufts": "0"})
    prompts = default_prompts()[:8]
    seqs = [r.prompt_token_ids + r.token_ids for r in ref.generate(
        [GenerationRequest(prompt=p, max_new_tokens=8) for p in prompts])]
    tok = ref.tokenizer
    # one context per (prompt, step), as text for the engine and as the reference tokenizes that text
    texts = [tok.decode(s[:p + 1], skip_special_tokens=False) for s in seqs for p in range(len(s) - 8, len(s))]
    seqs = [tok(t)["input_ids"] for t in texts]
    positions = [[len(s) - 1] for s in seqs]

    def ref_rows(adapter_path, quantised: bool):
        if not quantised:
            return ref.context_logprobs(seqs, positions, adapter_path, top=1024)
        m = ref._model_for(adapter_path)
        with quantised_activations(m, a.scheme):
            from lora_conformance.judge.hypotheses import correct

            return ref._context_rows(seqs, positions, adapter_path, correct(), None, 1024)

    def engine_rows(adapter):
        reqs = [GenerationRequest(prompt=t, max_new_tokens=1, top_k=20, adapter=adapter) for t in texts]
        out = eng.generate(reqs)
        return [o.logprobs[0] for o in out]

    flat = lambda rows: [r for seq in rows for r in seq]  # noqa: E731
    results = {}
    for name in a.adapters.split(","):
        path = synthesize_cached(model, DEFAULT_ADAPTERS[name], cache / "adapters")
        eng.load_adapter(name, path)
        R = (flat(ref_rows(None, False)), flat(ref_rows(path, False)))
        Rq = (flat(ref_rows(None, True)), flat(ref_rows(path, True)))
        L = (engine_rows(None), engine_rows(name))
        eng.unload_adapter(name)

        pairs = {"L-R": (L, R), "Rq-R": (Rq, R), "L-Rq": (L, Rq)}
        for label, (X, Y) in pairs.items():
            res = []
            for c in range(len(L[0])):
                ids = set(L[0][c]) & set(L[1][c])  # the engine's top-20 in both runs
                ids = [i for i in ids if i in X[0][c] and i in X[1][c] and i in Y[0][c] and i in Y[1][c]]
                ex = np.array([X[1][c][i] - X[0][c][i] for i in ids])
                ey = np.array([Y[1][c][i] - Y[0][c][i] for i in ids])
                d = (ex - ex.mean()) - (ey - ey.mean())  # centred effects, as compare/effects.py centres them
                res.extend(d.tolist())
            results.setdefault(label, []).append(float(np.sqrt(np.mean(np.square(res)))))
    for label, vals in results.items():
        print(f"{a.scheme} effect residual rms {label}: " + ", ".join(f"{v:.4f}" for v in vals)
              + f"  (adapters {a.adapters})")


if __name__ == "__main__":
    main()
