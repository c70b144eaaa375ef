"""Deliberate bugs for self-validation: ``--engine-arg fault=NAME`` switches exactly one on.

The engine reads the name once, when it loads (engine/plan.py turns it into the plain decisions
its parts take); no layer or part of the engine asks about a fault by name. Each fault alters
the code path its name says, so a conformance suite that is worth its
salt must fail against it. None is ever active without the engine arg. Faults marked
[streams] or [graphs] only change behaviour on a device with asynchronous streams or
graph capture; on cpu those code paths do not exist and the fault is inert. [compile] changes
the compiled decode step, which the engine declares where inductor emits Triton (not on cpu).
"""

from __future__ import annotations

from typing import Optional

FAULTS: dict[str, str] = {
    "base_gets_last_adapter": "base rows in a mixed batch receive the adapter in the batch's last used slot",
    "adapter_index_off_by_one": "adapter rows use slot index + 1 (the neighbouring adapter, or none)",
    "scaling_alpha_not_over_r": "LoRA scaling is lora_alpha instead of lora_alpha / r",
    "rslora_ignored": "use_rslora is ignored: scaling alpha / r instead of alpha / sqrt(r)",
    "patterns_ignored": "rank_pattern / alpha_pattern are ignored when computing the scaling",
    "lm_head_dropped": "lm_head LoRA is silently dropped",
    "embed_tokens_dropped": "embed_tokens LoRA is silently dropped",
    "stale_reload": "reloading an adapter name keeps the old weights",
    "unload_frees_same_directory": "an unload zeroes the device slots of every name loaded from the same directory: "
                                   "the other names stay listed and are served without their weights",
    "adapter_cache_keyed_by_path": "parsed adapters are cached by directory path: an adapter rewritten in place and "
                                   "loaded again serves the weights first read from that path",
    "slot_reuse_keeps_stale_ranks": "a load writes only its own ranks into a device slot: the ranks past them keep "
                                    "the slot's last occupant's factors (a lower-rank adapter where a higher-rank "
                                    "one was; an unload leaves the slot as it was)",
    "slot_reuse_keeps_stale_modules": "a load leaves the modules it does not target as the slot's last occupant left "
                                      "them (a narrower adapter where a wider one was; an unload leaves the slot "
                                      "as it was)",
    "reload_keeps_first_scaling": "a name loaded again (unloaded first or loaded over) gets the new weights but "
                                  "the scaling of its first load's config (r, lora_alpha, use_rslora, patterns)",
    "prefix_cache_ignores_adapter": "prefix cache blocks are keyed by tokens only, not by adapter identity",
    "evict_pinned": "eviction (host cache and device slots) may evict a pinned adapter",
    "lora_fp16": "the LoRA delta is computed in float16 whatever the model dtype",
    "graph_stale_indices": "[graphs] graph replay uses the adapter slot indices captured at capture time",
    "overlap_no_wait": "[streams] the compute stream does not wait on the overlap-load event",
    "moe_expert_mismatch": "MoE expert LoRA of expert e is applied to expert e+1 (mod E)",
    "moe_lora_unweighted": "an MoE expert's down_proj LoRA output is added unweighted, not multiplied by the "
                           "token's routing weight like the expert's base output",
    "moe_lora_weight_of_next_expert": "an MoE expert's down_proj LoRA output is multiplied by the routing weight "
                                      "of the token's next selected expert, not its own",
    "moe_lora_first_expert_only": "MoE expert LoRA is applied only to the first (highest-weight) of a token's "
                                  "selected experts",
    "delta_twice": "the LoRA delta is added twice",
    "batch_modules_of_first_adapter": "a batch applies LoRA only on the layers that the adapter of its first "
                                      "adapter row targets: other adapters' other modules are skipped (right when "
                                      "every adapter of a batch targets the same modules)",
    "delta_x1_1": "the LoRA delta is scaled by 1.1 (a 10% mis-scale)",
    "moe_down_proj_dropped": "the MoE experts' down_proj LoRA is silently dropped (gate_up_proj kept)",
    "embed_tokens_lora_from_first_slot": "embed_tokens LoRA of every adapter token is gathered from the first "
                                         "slot's weights (right when the adapter sits in slot 0)",
    "lm_head_lora_from_first_slot": "lm_head LoRA of every adapter row is read from the first slot's weights "
                                    "(right when the adapter sits in slot 0)",
    "embedding_adapter_misrouted": "an embedding batch's rows get the adapter of the next request in the batch",
    "prefix_cache_keyed_by_name": "prefix cache blocks are keyed by adapter name: a name reloaded with new weights hits stale KV",
    "chunk_continuation_drops_adapter": "prefill chunks after a prompt's first run without its adapter",
    "inflight_no_drain": "load / unload / reload of an adapter that running requests use neither waits nor refuses",
    "rotary_assumes_head_dim_64": "rotary frequencies are computed for head_dim 64 whatever the model's head_dim",
    "masked_prefill_padded_rows": "masked prefill routes packed token t by padded row t // longest (unequal prompts take a neighbour's adapter)",
    # [quant] quantised-base faults: only an int8 base (--base-quant int8) has these code paths
    "quant_delta_before_scale": "[quant] the LoRA delta is added to the int8 accumulator before the per-channel "
                                "dequantisation scale, so it is scaled with the base",
    "quant_lora_skipped": "[quant] layers with an int8 base, or a GGUF base read with 8-bit activations, apply no LoRA",
    "quant_scale_of_channel_0": "[quant] every output channel of an int8 layer is dequantised with channel 0's scale",
    # kernel-threshold and execution-mode faults: a path taken only above a rank, a batch width or a
    # sequence length, or only in one execution mode; caught by the full profile's shapes
    # (models/profiles.py) or the mode axis
    "rank_ge_128_truncated": "[threshold] adapters of rank >= 128 take a kernel tiled for 64 ranks: ranks 64 and up "
                             "contribute nothing (ranks below 128 are served right)",
    "decode_rows_over_32_wrap": "[threshold] a decode step of more than 32 rows reads the slots of rows 32 and up "
                                "from a 32-entry index buffer: row r takes row r - 32's adapter (prefill and decode "
                                "steps of 32 rows or fewer are right)",
    "batch_over_16_adapters_wraps": "[threshold] a batch with more than 16 distinct adapters indexes slots with 4 "
                                    "bits: rows of slot 16 and up read slot - 16 (16 or fewer are served right)",
    "positions_over_4096_as_base": "[threshold] the token-to-adapter map holds 4096 positions a request: tokens at "
                                   "position 4096 and later, in prefill and decode, are served without their "
                                   "adapter (requests shorter than 4096 tokens are right)",
    "compile_drops_lora": "[compile] the compiled decode step runs without the LoRA delta (as intel/llm-scaler#634 "
                          "under torch.compile); eager and graph decode, and prefill, are right",
    # [tp] sharding faults: only a tensor-parallel engine (tensor_parallel_size > 1) has these code paths
    "tp_scaling_per_shard": "[tp] row-parallel layers keep the scaled LoRA B on every rank: the delta, scaling "
                            "included, is added per shard before the all-reduce (tp times over)",
    "tp_packed_slice_as_one_block": "[tp] packed q/k/v and gate/up LoRA B is sharded as one block over the packed "
                                    "output, not per slice",
    "tp_b_shard_wrong_rank": "[tp] column-parallel LoRA B shards are taken from the next rank's slice",
}

# One fault per linear target module, its LoRA silently dropped (the module is still targeted in
# the adapter's config, and the rest of the adapter is applied): fault ``drop_<module>``.
DROPPABLE_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FAULTS.update({f"drop_{m}": f"{m} LoRA weights are silently dropped" for m in DROPPABLE_LINEAR_MODULES})

# Faults whose code path exists only on accelerators (cpu runs in order and has no graphs).
DEVICE_ONLY_FAULTS: dict[str, str] = {"graph_stale_indices": "graphs", "overlap_no_wait": "streams",
                                      "compile_drops_lora": "compile"}

# Thresholds of the kernel-threshold faults (what the fast profile stays under, the full one crosses).
RANK_TILE_THRESHOLD, RANK_TILE = 128, 64
SLOT_INDEX_BITS_ADAPTERS = 16
DECODE_INDEX_ROWS = 32
ADAPTER_MAP_POSITIONS = 4096  # positions_over_4096_as_base: the fast profile's prompts are tens of tokens

# Faults that only change results in some model dtypes: dtype -> why not in the others.
DTYPE_ONLY_FAULTS: dict[str, tuple[tuple[str, ...], str]] = {
    "lora_fp16": (("float32",), "a float16 delta is no less precise than bfloat16 / float16 arithmetic"),
}


class Faults:
    """The one active fault (or none), checked against the catalogue; ``on("name")`` is asked by
    engine/plan.py alone."""

    def __init__(self, name: Optional[str] = None):
        if name in ("", "none"):
            name = None
        if name is not None and name not in FAULTS:
            catalogue = "\n".join(f"  {k}: {v}" for k, v in FAULTS.items())
            raise ValueError(f"unknown fault {name!r}; the catalogue:\n{catalogue}")
        self.name = name

    def on(self, name: str) -> bool:
        assert name in FAULTS, name  # a typo here would make a fault silently inert
        return self.name == name

    def __repr__(self) -> str:
        return f"Faults({self.name!r})"
