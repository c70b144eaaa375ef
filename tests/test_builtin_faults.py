"""Every fault in the built-in engine's catalogue really changes behaviour (on cpu, those
whose code path exists here); without ``fault=`` none is active."""

from __future__ import annotations

import pytest

from _builtin_models import build_adapter, build_bert, build_decoder
from lora_conformance.engines.builtin import FAULTS, BuiltinEngine
from lora_conformance.engines.builtin.faults import DEVICE_ONLY_FAULTS, DROPPABLE_LINEAR_MODULES, Faults
from lora_conformance.types import GenerationRequest

PROMPT = "the cat sat on the mat and the dog ran fast to the big red tree"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("builtin_faults")
    base = build_decoder(d / "base", seed=2)
    from lora_conformance.models.quant import snapped_checkpoint
    moe = build_decoder(d / "moe", arch="qwen3_moe", seed=2)
    bert = build_bert(d / "bert", seed=2)
    return {
        "base": base, "moe": moe, "bert": bert,
        "int8": snapped_checkpoint(base, "int8", d / "quantized"),  # the quant_* faults' int8 base
        "e1": build_adapter(bert, d / "e1", 7, encoder=True),
        "e2": build_adapter(bert, d / "e2", 8, encoder=True),
        "a1": build_adapter(base, d / "a1", 1, r=8, alpha=16),
        "a2": build_adapter(base, d / "a2", 2, r=4, alpha=8),
        "a1_alpha64": build_adapter(base, d / "a1_alpha64", 1, r=8, alpha=64),
        "rs": build_adapter(base, d / "rs", 3, r=16, alpha=8, use_rslora=True),
        "pat": build_adapter(base, d / "pat", 4, r=8, alpha=8, rank_pattern={"q_proj": 2}, alpha_pattern={"o_proj": 64}),
        "emb": build_adapter(base, d / "emb", 5, r=4, alpha=8, target_modules=["embed_tokens", "lm_head"]),
        "moe_ad": build_adapter(moe, d / "moe_ad", 6, r=4, alpha=8, target_modules=["q_proj"],
                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    }


def scenario(w, fault, active: bool):
    """Run the scenario that exposes ``fault``, with it switched on or not; return observables."""
    args = {"fault": fault} if active else {}
    model = (w["moe"] if fault.startswith("moe_") else w["bert"] if fault.startswith("embedding_")
             else w["int8"] if fault.startswith("quant_") else w["base"])
    if fault == "evict_pinned":
        args.update(max_loras_per_batch="2", max_loaded_loras="2")
    if fault.startswith("prefix_cache_"):
        args.update(kv_block_size="4")
    if fault == "chunk_continuation_drops_adapter":
        args.update(chunked_prefill_size="4")
    if fault == "masked_prefill_padded_rows":
        args.update(lora_backend="masked")
    with BuiltinEngine(model, "cpu", "float32", args) as eng:
        load = {"base_gets_last_adapter": ["a1"], "adapter_index_off_by_one": ["a1", "a2"],
                "scaling_alpha_not_over_r": ["a1"], "rslora_ignored": ["rs"], "patterns_ignored": ["pat"],
                "drop_v_proj": ["a1"], "lm_head_dropped": ["emb"], "embed_tokens_dropped": ["emb"],
                "lora_fp16": ["a1"], "delta_twice": ["a1"], "moe_expert_mismatch": ["moe_ad"],
                "prefix_cache_ignores_adapter": ["a1"], "delta_x1_1": ["a1"], "moe_down_proj_dropped": ["moe_ad"],
                "moe_lora_unweighted": ["moe_ad"], "moe_lora_weight_of_next_expert": ["moe_ad"],
                "moe_lora_first_expert_only": ["moe_ad"],
                "embedding_adapter_misrouted": ["e1", "e2"],
                "chunk_continuation_drops_adapter": ["a1"], "masked_prefill_padded_rows": ["a1", "a2"],
                "inflight_no_drain": ["a1"], "embed_tokens_lora_from_first_slot": ["a1", "emb"],
                "lm_head_lora_from_first_slot": ["a1", "emb"],
                **{f"drop_{m}": ["a1"] for m in DROPPABLE_LINEAR_MODULES},
                **{f: ["a1"] for f in ("quant_delta_before_scale", "quant_lora_skipped", "quant_scale_of_channel_0")},
                }.get(fault, [])
        for n in load:
            eng.load_adapter(n, w[n])
        names = {"base_gets_last_adapter": [None, "a1"], "adapter_index_off_by_one": ["a1", "a2"]}.get(fault, load)

        def gen(ns, **kw):
            return [r.logprobs for r in eng.generate(
                [GenerationRequest(PROMPT, n, max_new_tokens=3, top_k=5, **kw) for n in ns])]

        if fault == "masked_prefill_padded_rows":  # packed rows of unequal prompts
            return [r.logprobs for r in eng.generate([GenerationRequest(p, n, max_new_tokens=3, top_k=5) for p, n in (
                (PROMPT, "a1"), ("the cat", None), (PROMPT + " and back", "a2"))])]
        if fault == "inflight_no_drain":  # an unload returns while a request using the adapter still runs
            handle = eng.submit([GenerationRequest(PROMPT, "a1", max_new_tokens=48)])
            assert handle.wait_started(60)
            eng.unload_adapter("a1")
            return [handle.done()]
        if fault == "rotary_assumes_head_dim_64":  # this model's head_dim is 16
            return gen([None])
        if fault == "stale_reload":
            eng.load_adapter("x", w["a1"])
            gen(["x"])
            eng.load_adapter("x", w["a2"])
            return gen(["x"])
        if fault == "reload_keeps_first_scaling":  # the same factors under another alpha
            eng.load_adapter("x", w["a1"])
            gen(["x"])
            eng.load_adapter("x", w["a1_alpha64"])
            return gen(["x"])
        if fault in ("slot_reuse_keeps_stale_ranks", "slot_reuse_keeps_stale_modules"):
            eng.load_adapter("wide", w["rs"])  # rank 16, every linear module
            gen(["wide"])
            eng.unload_adapter("wide")
            narrow = "a2" if fault.endswith("ranks") else "emb"  # rank 4 / embed_tokens and lm_head only
            eng.load_adapter("narrow", w[narrow])
            return gen(["narrow"])
        if fault == "adapter_cache_keyed_by_path":  # the same directory, written again between the loads
            import shutil

            where = w["base"].parent / "rewritten"
            shutil.copytree(w["a1"], where, dirs_exist_ok=True)
            eng.load_adapter("x", where)
            gen(["x"])
            eng.unload_adapter("x")
            shutil.copytree(w["a2"], where, dirs_exist_ok=True)
            eng.load_adapter("x", where)
            return gen(["x"])
        if fault == "unload_frees_same_directory":
            eng.load_adapter("x", w["a1"])
            eng.load_adapter("y", w["a1"])
            gen(["x", "y"])
            eng.unload_adapter("x")
            return gen(["y"])
        if fault == "batch_modules_of_first_adapter":  # a1 targets every linear module, emb none of them
            for n in ("emb", "a1"):
                eng.load_adapter(n, w[n])
            return gen(["emb", "a1"])
        if fault == "decode_rows_over_32_wrap":  # a decode step of 40 rows
            for n in ("a1", "a2"):
                eng.load_adapter(n, w[n])
            return gen([("a1", None, "a2")[i % 3] for i in range(40)])
        if fault in ("embed_tokens_lora_from_first_slot", "lm_head_lora_from_first_slot"):
            return gen(["a1", "emb"])  # emb in the second slot
        if fault == "prefix_cache_ignores_adapter":
            gen([None])  # fills the cache with base KV for PROMPT
            return gen(["a1"])
        if fault == "prefix_cache_keyed_by_name":
            eng.load_adapter("x", w["a1"])
            gen(["x"])  # fills the cache with x = a1's KV for PROMPT
            eng.unload_adapter("x")
            eng.load_adapter("x", w["a2"])
            return gen(["x"])
        if fault == "embedding_adapter_misrouted":
            return eng.embed([PROMPT, "the dog ran", "a big red sun"], ["e1", None, "e2"])
        if fault == "evict_pinned":
            eng.load_adapter("a1", w["a1"], pinned=True)
            eng.load_adapter("a2", w["a2"])
            eng.load_adapter("rs", w["rs"])
            return ["a1" in eng.resident_adapters()]
        if fault == "lm_head_dropped":  # lm_head LoRA also reaches prompt logprobs
            return [r.prompt_logprobs for r in eng.generate([GenerationRequest(PROMPT, "emb", 1, prompt_logprobs=True)])]
        return gen(names)


def differ(a, b, tol: float) -> bool:
    if a == b:
        return False
    if isinstance(a, dict):
        return a.keys() != b.keys() or max(abs(a[k] - b[k]) for k in a) > tol
    if isinstance(a, list):
        return len(a) != len(b) or any(differ(x, y, tol) for x, y in zip(a, b))
    return a != b


# Faults whose scenario needs a configuration this module's tiny models do not have (chunked
# prefill over long prompts, concurrent submissions, head_dim 128/256, the masked prefill path over
# unequal prompts, a tensor-parallel engine of two processes, adapters of rank 128 and up, more than
# 16 adapters in a batch, prompts past 4096 tokens): their change of behaviour is shown by the
# suites that catch them (tests/test_detection_power.py, which fails when a catcher passes;
# tests/test_profiles.py checks the threshold faults' plan decisions).
SHOWN_BY_THE_SUITES = ("chunk_continuation_drops_adapter", "inflight_no_drain", "rotary_assumes_head_dim_64",
                       "masked_prefill_padded_rows", "tp_scaling_per_shard", "tp_packed_slice_as_one_block",
                       "tp_b_shard_wrong_rank", "rank_ge_128_truncated", "batch_over_16_adapters_wraps",
                       "positions_over_4096_as_base")
HOST_FAULTS = [f for f in FAULTS if f not in DEVICE_ONLY_FAULTS and f not in SHOWN_BY_THE_SUITES]


def test_faults_shown_by_the_suites_have_catchers():
    from test_detection_power import CATCHERS

    assert all(CATCHERS.get(f) for f in SHOWN_BY_THE_SUITES)


@pytest.mark.parametrize("fault", HOST_FAULTS)
def test_fault_changes_behaviour(world, fault):
    healthy, broken = scenario(world, fault, False), scenario(world, fault, True)
    tol = 1e-6 if fault == "lora_fp16" else 1e-3
    assert differ(healthy, broken, tol), f"fault {fault} left the observables unchanged"


def test_catalogue():
    assert len(FAULTS) == 52 and set(DEVICE_ONLY_FAULTS) == {"graph_stale_indices", "overlap_no_wait",
                                                             "compile_drops_lora"}
    assert Faults(None).name is None and Faults("").name is None
    assert not any(Faults(None).on(f) for f in FAULTS)
    with pytest.raises(ValueError, match="unknown fault"):
        Faults("nope")
