"""What the built-in engine decides once, when it loads: its LoRA path, its fault, its variant.

``EnginePlan.decide`` reads the engine args (``fault``, ``variant``, ``lora_backend``) and the
device, and answers each question the engine's parts ask as plain data: how rows are routed
to slots, in which dtype and how many times the delta is added, how the MoE experts apply
their LoRA, how an adapter's factors are scaled and stored, what keys the prefix cache. Each
part takes its answers when it is built; the per-forward ones ride in the batch description
(``layers/lora.py``: ``LoraBatch``). No part, and no layer, asks about a fault by name: the
catalogue's names (``faults.py``) are read here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lora_conformance import devices
from lora_conformance.checkpoints import scaling_rule
from lora_conformance.engines.builtin.faults import (ADAPTER_MAP_POSITIONS, DECODE_INDEX_ROWS, DROPPABLE_LINEAR_MODULES,
                                                    RANK_TILE, RANK_TILE_THRESHOLD, SLOT_INDEX_BITS_ADAPTERS, Faults)
from lora_conformance.engines.builtin.engine.sharding import ShardRules
from lora_conformance.engines.builtin.layers.int8_linear import QuantRules
from lora_conformance.engines.builtin.layers.lora import ExpertLora
from lora_conformance.engines.builtin.variants import Variant


@dataclass(frozen=True)
class Routing:
    """How the model runner maps the rows' own slots to the slots the LoRA layers read."""

    shift: int = 0  # adapter rows read slot + shift
    base_takes_last: bool = False  # base rows read the batch's last used slot
    embed_rotated: bool = False  # an embedding batch's rows read the next text's slot
    chunk_continuation_base: bool = False  # prefill chunks after a prompt's first run as base
    masked_by_padded_row: bool = False  # masked prefill reads packed token t's slot at padded row t // longest
    embed_tokens_first_slot: bool = False  # the token embedding's LoRA reads slot 0 for every adapter token
    lm_head_first_slot: bool = False  # the lm_head LoRA reads slot 0 for every adapter row
    wrap_above: int = 0  # a batch of more distinct adapters than this reads slot mod this (0: never)
    decode_index_rows: int = 0  # a decode step of more rows than this: row r reads row r mod this's slot (0: never)
    modules_of_first_adapter: bool = False  # a batch's LoRA layers are those its first adapter row's adapter targets
    position_limit: int = 0  # tokens at this position of their request or later read no slot (0: never)

    def route(self, slots: list[int]) -> list[int]:
        """Each row's adapter slot as the LoRA layers read it (-1: base), from the rows' own slots."""
        if self.wrap_above and len({x for x in slots if x >= 0}) > self.wrap_above:
            slots = [x % self.wrap_above if x >= 0 else x for x in slots]
        if self.shift:
            slots = [x + self.shift if x >= 0 else x for x in slots]
        if self.base_takes_last:
            used = [x for x in slots if x >= 0]
            if used:
                slots = [x if x >= 0 else max(used) for x in slots]
        return slots

    def decode_rows(self, slots: list[int]) -> list[int]:
        """A decode step's routed slots (``route``'s), as the decode step's index buffer holds them."""
        n = self.decode_index_rows
        return [slots[i % n] for i in range(len(slots))] if n and len(slots) > n else slots

    def by_position(self, slots: list[int], positions) -> list[int]:
        """Each token's routed slot given its position in its request (``position_limit``)."""
        n = self.position_limit
        return [x if p < n else -1 for x, p in zip(slots, positions)] if n else slots

    def embed_route(self, slots: list[int]) -> list[int]:
        rows = self.route(slots)
        if self.embed_rotated and rows:
            rows = rows[1:] + rows[:1]
        return rows


@dataclass(frozen=True)
class Scaling:
    """How an adapter module's scaling is computed from its config (correct: every field default:
    PEFT's rule, ``checkpoints.scaling_rule``; each fault leaves out one of its parts)."""

    patterns: bool = True  # rank_pattern / alpha_pattern honoured
    rslora: bool = True  # use_rslora honoured
    over_rank: bool = True  # alpha / r (False: alpha alone)
    factor: float = 1.0  # a mis-scale

    def of(self, r0: int, alpha0: float, rm: int, am: float, use_rslora: bool) -> float:
        if not self.patterns:
            rm, am = r0, alpha0
        scale = scaling_rule(rm, am, use_rslora and self.rslora) if self.over_rank else am
        return scale * self.factor if self.factor != 1.0 else scale


@dataclass(frozen=True)
class AdapterRules:
    """How an adapter directory becomes the pool's packed factors."""

    scaling: Scaling = Scaling()
    dropped: frozenset = frozenset()  # (kind, module leaf) pairs whose LoRA is not packed
    variant: Variant = Variant()  # how the factors are stored (rescale, preround)
    # (threshold, kept): adapters of rank >= threshold keep only their first ``kept`` ranks (None: all)
    rank_tile: Optional[tuple] = None

    def drops(self, target: str, kind: str) -> bool:
        return (kind, target.rsplit(".", 1)[-1]) in self.dropped


@dataclass(frozen=True)
class EnginePlan:
    fault: Optional[str] = None  # the fault's name, for what the engine reports (settings)
    variant: Variant = Variant()
    routing: Routing = Routing()
    adapters: AdapterRules = AdapterRules()
    segmented_prefill: bool = True  # prefill rows in per-adapter segments (else masked, as decode)
    reverse_order: bool = False  # prefill rows and request admission in reverse order
    one_at_a_time: bool = False  # each request served alone
    delta_dtype: Any = None  # torch dtype of the LoRA delta where it is not the model's
    delta_times: int = 1  # how many times the delta is added
    experts: ExpertLora = ExpertLora()
    rope_exponent_dim: int = 0  # the dimension in rotary theta's exponent (0: the head dim)
    prefix_salt: str = "identity"  # the prefix cache's adapter key: identity | name | none
    reload_reads_weights: bool = True  # reloading a name reads the new weights
    cache_by_path: bool = False  # a load from a directory read before takes that read's weights (no re-read)
    reload_reads_scaling: bool = True  # reloading a name reads the new config's scaling
    evict_pinned: bool = False  # eviction may take a pinned adapter
    unload_frees_path: bool = False  # an unload also clears the slots of other names loaded from its directory
    # A device slot's reuse: a load writes every rank of every module (zeros past its own), an unload zeroes
    # the slot. Under the slot_reuse_* faults a load writes only its own ranks / modules, an unload nothing.
    slot_writes_own_ranks_only: bool = False
    slot_keeps_absent_modules: bool = False
    drain_before_change: bool = True  # adapter changes wait for the requests that use the name
    graphs_refresh_slots: bool = True  # graph replay writes the rows' slots every step
    compiled_applies_lora: bool = True  # the compiled decode step (exec_mode=compile) reads the rows' slots
    wait_for_loads: bool = True  # the compute stream waits for the overlap-load event
    shards: ShardRules = ShardRules()  # how each tensor-parallel rank cuts an adapter (engine/sharding.py)
    quant: QuantRules = QuantRules()  # how an int8 base applies its scale and LoRA (layers/int8_linear.py)

    @classmethod
    def decide(cls, cfg, device: str, dtype) -> "EnginePlan":
        """The plan of an engine started with args ``cfg`` (builtin EngineArgs) on ``device`` in
        torch dtype ``dtype``."""
        import torch

        f, v = Faults(cfg.fault), cfg.variant
        delta = torch.float16 if f.on("lora_fp16") else torch.float32 if v.on("fp32_delta") else None
        weighting = ("unweighted" if f.on("moe_lora_unweighted") else
                     "next_expert" if f.on("moe_lora_weight_of_next_expert") else "routed")
        dropped = {("linear", m) for m in DROPPABLE_LINEAR_MODULES if f.on(f"drop_{m}")}
        if f.on("lm_head_dropped"):
            dropped.add(("linear", "lm_head"))
        if f.on("embed_tokens_dropped"):
            dropped.add(("embedding", "embed_tokens"))
        if f.on("moe_down_proj_dropped"):
            dropped.add(("expert", "down_proj"))
        backend = getattr(cfg, "lora_backend", "auto")
        return cls(
            fault=f.name, variant=v,
            routing=Routing(shift=1 if f.on("adapter_index_off_by_one") else 0,
                            base_takes_last=f.on("base_gets_last_adapter"),
                            embed_rotated=f.on("embedding_adapter_misrouted"),
                            chunk_continuation_base=f.on("chunk_continuation_drops_adapter"),
                            masked_by_padded_row=f.on("masked_prefill_padded_rows"),
                            embed_tokens_first_slot=f.on("embed_tokens_lora_from_first_slot"),
                            lm_head_first_slot=f.on("lm_head_lora_from_first_slot"),
                            wrap_above=SLOT_INDEX_BITS_ADAPTERS if f.on("batch_over_16_adapters_wraps") else 0,
                            decode_index_rows=DECODE_INDEX_ROWS if f.on("decode_rows_over_32_wrap") else 0,
                            position_limit=ADAPTER_MAP_POSITIONS if f.on("positions_over_4096_as_base") else 0,
                            modules_of_first_adapter=f.on("batch_modules_of_first_adapter")),
            adapters=AdapterRules(Scaling(patterns=not f.on("patterns_ignored"), rslora=not f.on("rslora_ignored"),
                                          over_rank=not f.on("scaling_alpha_not_over_r"),
                                          factor=1.1 if f.on("delta_x1_1") else 1.0),
                                  frozenset(dropped), v,
                                  (RANK_TILE_THRESHOLD, RANK_TILE) if f.on("rank_ge_128_truncated") else None),
            # cpu: FLOPs dominate and launches are cheap, one shrink/expand per adapter segment;
            # accelerators: launches dominate, every slot at once, masked. Decode is always masked.
            segmented_prefill=backend == "segmented" or backend == "auto" and devices.device_type(device) == "cpu",
            reverse_order=v.on("reverse"), one_at_a_time=v.on("one_at_a_time"),
            delta_dtype=None if delta == dtype else delta,
            delta_times=2 if f.on("delta_twice") else 1,
            experts=ExpertLora(1 if f.on("moe_expert_mismatch") else 0, f.on("moe_lora_first_expert_only"), weighting),
            rope_exponent_dim=64 if f.on("rotary_assumes_head_dim_64") else 0,
            prefix_salt=("none" if f.on("prefix_cache_ignores_adapter") else
                         "name" if f.on("prefix_cache_keyed_by_name") else "identity"),
            reload_reads_weights=not f.on("stale_reload"),
            cache_by_path=f.on("adapter_cache_keyed_by_path"),
            reload_reads_scaling=not f.on("reload_keeps_first_scaling"),
            evict_pinned=f.on("evict_pinned"),
            unload_frees_path=f.on("unload_frees_same_directory"),
            slot_writes_own_ranks_only=f.on("slot_reuse_keeps_stale_ranks"),
            slot_keeps_absent_modules=f.on("slot_reuse_keeps_stale_modules"),
            drain_before_change=not f.on("inflight_no_drain"),
            graphs_refresh_slots=not f.on("graph_stale_indices"),
            compiled_applies_lora=not f.on("compile_drops_lora"),
            wait_for_loads=not f.on("overlap_no_wait"),
            shards=ShardRules(b_rank_offset=1 if f.on("tp_b_shard_wrong_rank") else 0,
                              packed_as_one_block=f.on("tp_packed_slice_as_one_block"),
                              row_b_on_every_rank=f.on("tp_scaling_per_shard")),
            quant=QuantRules(delta_before_scale=f.on("quant_delta_before_scale"),
                             skip_lora=f.on("quant_lora_skipped"), one_scale=f.on("quant_scale_of_channel_0"),
                             activations=getattr(cfg, "activations", "float")),
        )
