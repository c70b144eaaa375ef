"""Repro: openvino-genai 2026.4, ContinuousBatchingPipeline with prefix caching -- a prompt served
under one LoRA adapter leaves KV blocks that a later request with another adapter (or none) reuses.

Found by the lora-conformance suites (prefix_cache::hit_equals_miss and
prefix_cache::adapters_never_share_cached_entries on the ``openvino`` engine); builtin passes them.
This script uses GenAI alone (no plugin code on the serving path): one pipeline with prefix caching,
one without, the same greedy requests; the second request's tokens and score must not depend on
what the first request left in the cache.

    lora-conformance synth model llama --out /tmp/llama
    lora-conformance synth adapter --base /tmp/llama --out /tmp/adapter --seed 411 --targets all-linear --b-std 0.09
    python ci/repro/openvino_prefix_cache_ignores_adapter.py /tmp/llama /tmp/adapter

(the IR is converted by lora_conformance.engines.openvino_convert, cached under /tmp/ov-ir).
Prints, for base-after-adapter and adapter-after-base, the cached pipeline's answer next to the
uncached one's; "DIFFERENT" is the bug.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    import openvino_genai as g

    from lora_conformance.engines.openvino_convert import converted_model

    model, adapter_dir = Path(sys.argv[1]), Path(sys.argv[2])
    ir = converted_model(model, Path("/tmp/ov-ir"))
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter = g.Adapter(str(adapter_dir / "adapter_model.safetensors"))
    scaling = cfg["lora_alpha"] / cfg["r"]

    def pipeline(prefix: bool):
        sched = g.SchedulerConfig()
        sched.cache_size = 1
        sched.enable_prefix_caching = prefix
        props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                 "adapters": g.AdapterConfig(adapter, scaling)}
        return g.ContinuousBatchingPipeline(str(ir), sched, "CPU", props)

    def config(with_adapter: bool):
        c = g.GenerationConfig()
        c.max_new_tokens, c.ignore_eos, c.do_sample = 12, True, False
        c.adapters = g.AdapterConfig(adapter, scaling) if with_adapter else g.AdapterConfig()
        return c

    prompt = " ".join(["once upon a time there was a dragon who lived in the old castle by the sea"] * 4)
    for first, second in ((True, False), (False, True)):
        answers = {}
        for prefix in (True, False):
            pipe = pipeline(prefix)
            ids = pipe.get_tokenizer().encode(prompt).input_ids
            pipe.generate([ids], [config(first)])
            r = pipe.generate([ids], [config(second)])[0]
            answers[prefix] = (list(r.m_generation_ids[0]), round(r.m_scores[0], 4))
        what = f"{'adapter' if second else 'base'} after {'adapter' if first else 'base'}"
        verdict = "same" if answers[True] == answers[False] else "DIFFERENT"
        print(f"{what}: prefix cache {answers[True]} | no cache {answers[False]}: {verdict}")


if __name__ == "__main__":
    main()
