"""The model runner owns every device tensor: weights, KV cache, LoRA slot pools, graphs.

It turns a scheduled batch into flat tensors (tokens, positions, cache slots, per-token
adapter slots), runs the model, and returns greedy tokens with top-k logprobs on the host
(one device->host transfer per step, none per layer).
"""

from __future__ import annotations

from typing import Optional

import torch

from lora_conformance import devices
from lora_conformance.engines.builtin.engine.adapter import HostAdapter, model_lora_modules
from lora_conformance.engines.builtin.engine.sequence import Sequence
from lora_conformance.engines.builtin.engine.sharding import Sharder
from lora_conformance.engines.builtin.layers.attention import AttentionMetadata, additive_mask, build_mask, decode_mask
from lora_conformance.engines.builtin.layers.lora import LoraBatch, column_slots, segments_of
from lora_conformance.engines.builtin.layers.sampler import greedy_with_topk

StepOutput = tuple[int, list[tuple[int, float]], Optional[list[list[tuple[int, float]]]]]


class ModelRunner:
    def __init__(self, model, spec, args, plan, device: str, dtype, num_blocks: int):
        self.model, self.spec, self.args, self.plan = model, spec, args, plan
        self.device, self.dtype = device, dtype
        self.num_slots, self.rank = args.max_loras_per_batch, args.max_rank
        self.block_size = args.kv_block_size
        self.delta_dtype = plan.delta_dtype  # the LoRA delta's dtype where it is not the model's
        self.lora_modules = model_lora_modules(model)
        self.sharder = Sharder(self.lora_modules, plan.shards)  # each rank's cut of an adapter (one device: none)
        # The widest pool layout is q/k/v's three parts; every LoRA mask is a prefix of its columns.
        self.col_slots = column_slots(self.num_slots, self.rank, 3, device)
        self.module_gate = None  # only under the fault batch_modules_of_first_adapter (row_slots)
        self.layout_version = 0  # bumped when a module's pool is allocated: graphs must be recaptured
        self.lora_signature: tuple = ()
        self.load_stream = devices.new_stream(device) if args.overlap_loading else None
        self._inflight: list = []  # host tensors of copies that may still be running
        if spec.kind != "encoder":
            shape = (num_blocks, self.block_size, 2, model.kv_heads, spec.head_dim)  # this rank's KV heads
            model.kv_caches = [devices.zeros(shape, dtype, device) for _ in range(spec.num_layers)]
        self.segmented_prefill = plan.segmented_prefill  # how prefill routes LoRA rows (engine/plan.py)
        self.graphs = None
        if args.decode_mode != "eager" and spec.kind == "decoder":
            from lora_conformance.engines.builtin.engine.graph_runner import DecodeGraphs

            self.graphs = DecodeGraphs(self, compiled=args.decode_mode == "compile")

    # ---- adapter slots -------------------------------------------------------------
    def load_slots(self, copies: list[tuple[int, HostAdapter]]) -> None:
        """Copy adapters into their slots; with overlap loading on a side stream + event."""
        if not copies:
            return
        for _, ad in copies:
            for name in ad.modules:
                _, mod = self.lora_modules[name]
                if not self._pool_of(mod):
                    mod.alloc_pool(self.num_slots, self.rank)
                    self.layout_version += 1
        compute = devices.current_stream(self.device)
        side = self.load_stream
        if side is not None:
            side.wait_stream(compute)  # the slot may still be read by queued work
        ctx = devices.stream_context(self.device, side) if side is not None else _null()
        with ctx:
            for slot, ad in copies:
                for name, (_, mod) in self.lora_modules.items():
                    if not self._pool_of(mod):
                        continue
                    p = ad.modules.get(name)
                    A, Bt = self._pool_of(mod)
                    if p is None:
                        if self.plan.slot_keeps_absent_modules:
                            continue  # fault: the last occupant's factors stay, and are read
                        if mod.slot_rank[slot]:
                            A[..., slot, :, :].zero_() if A.dim() == 4 else A[slot].zero_()
                            Bt[..., slot, :, :].zero_() if Bt.dim() == 4 else Bt[slot].zero_()
                        mod.slot_rank[slot] = 0
                        continue
                    nb = p.A.is_pinned()
                    pa, pb = self.sharder.cut(name, p, ad)
                    # experts: (E, S, R, in)
                    dst_a, dst_b = (A[:, slot], Bt[:, slot]) if A.dim() == 4 else (A[slot], Bt[slot])
                    if self.plan.slot_writes_own_ranks_only:  # fault: ranks past p.rank keep the last occupant's
                        # the rank axis: last of an embedding's A (vocab, R), else the one before the last
                        a_axis = dst_a.dim() - 1 if hasattr(mod, "lora_At") else dst_a.dim() - 2
                        dst_a, pa = dst_a.narrow(a_axis, 0, p.rank), pa.narrow(a_axis, 0, p.rank)
                        dst_b, pb = dst_b.narrow(dst_b.dim() - 2, 0, p.rank), pb.narrow(pb.dim() - 2, 0, p.rank)
                    dst_a.copy_(pa, non_blocking=nb)
                    dst_b.copy_(pb, non_blocking=nb)
                    mod.slot_rank[slot] = p.rank
                self._inflight.append(ad)
        # Which modules have any LoRA at all is host state the forward branches on: graphs key on it.
        self.lora_signature = tuple(bool(any(m.slot_rank)) for _, m in self.lora_modules.values())
        if side is not None:
            event = devices.new_event(self.device)
            event.record(side)
            if self.plan.wait_for_loads:
                devices.wait_event(self.device, event, compute)
        self._inflight = self._inflight[-2 * self.num_slots:]

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        """Zero a freed slot in every pool (in stream order with queued work that reads it)."""
        if self.plan.slot_writes_own_ranks_only or self.plan.slot_keeps_absent_modules:
            return  # the slot_reuse_* faults: freed in the pool's bookkeeping only
        for _, mod in self.lora_modules.values():
            pool = self._pool_of(mod)
            if pool is None:
                continue
            for t in pool:
                t[:, slot].zero_() if t.dim() == 4 else t[slot].zero_()
            mod.slot_rank[slot] = 0
        self.lora_signature = tuple(bool(any(m.slot_rank)) for _, m in self.lora_modules.values())

    @staticmethod
    def _pool_of(mod):
        if hasattr(mod, "lora_At"):
            return None if mod.lora_At is None else (mod.lora_At, mod.lora_Bt)
        return None if mod.lora_A is None else (mod.lora_A, mod.lora_Bt)

    # ---- routing ---------------------------------------------------------------------
    def row_slots(self, seqs: list[Sequence]) -> list[int]:
        slots = self.route([s.slot for s in seqs])
        if self.plan.routing.modules_of_first_adapter:  # the fault: the next forward's layers gated by this slot
            self.module_gate = next((x for x in slots if x >= 0), None)
        return slots

    def route(self, slots: list[int]) -> list[int]:
        """Each row's adapter slot as the LoRA layers read it (-1: base), from the rows' own slots."""
        return self.plan.routing.route(slots)

    def embed_row_slots(self, slots: list[int]) -> list[int]:
        """route() for an embedding batch, one slot per text."""
        return self.plan.routing.embed_route(slots)

    def lora_batch(self, token_slots: torch.Tensor, segments) -> LoraBatch:
        """The batch description every LoRA layer of the forward reads (routing and the plan's delta rules)."""
        embed = _first_slot(token_slots) if self.plan.routing.embed_tokens_first_slot else None
        return LoraBatch.build(token_slots, self.num_slots, self.dtype, segments,
                               delta_dtype=self.delta_dtype, times=self.plan.delta_times,
                               col_slots=self.col_slots, col_rank=self.rank, experts=self.plan.experts,
                               embed_slots=embed, module_gate=self.module_gate)

    def logits_batch(self, lora: LoraBatch, rows: Optional[torch.Tensor] = None,
                     row_slots: Optional[list[int]] = None) -> LoraBatch:
        """The routing the lm_head reads: ``lora``'s rows ``rows`` (None: every row; ``row_slots``
        their slots, given for a segmented batch), the slots moved to slot 0 under the fault
        lm_head_lora_from_first_slot."""
        if not self.plan.routing.lm_head_first_slot:
            if rows is None:
                return lora
            return lora.rows(rows, None if row_slots is None else segments_of(row_slots))
        slots = _first_slot(lora.token_slots if rows is None else lora.token_slots[rows])
        return self.lora_batch(slots, None if row_slots is None else segments_of([0 if x >= 0 else x for x in row_slots]))

    def _t(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    # ---- prefill -----------------------------------------------------------------------
    def prefill_slots(self, seqs: list[Sequence]) -> list[int]:
        slots = self.row_slots(seqs)
        if self.plan.routing.chunk_continuation_base:  # a chunk after the prompt's first: base
            slots = [-1 if s.num_computed > s.num_cached else x for s, x in zip(seqs, slots)]
        return slots

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> dict[int, StepOutput]:
        """Compute each sequence's tokens [num_computed, chunk_end). The chunk that ends the
        sequence samples its next token; prompt-logprob rows come from every chunk."""
        # contiguous per-adapter segments (SGMV); variant reverse: in the opposite order
        seqs = sorted(seqs, key=lambda s: s.slot, reverse=self.plan.reverse_order)
        bs = self.block_size
        ids, pos, smap, tok_slots, q_lens, ctx_lens, logit_rows = [], [], [], [], [], [], []
        q_index, out_index = [], []
        slots = self.prefill_slots(seqs)
        Lq = max(s.chunk_end - s.num_computed for s in seqs)
        for b, (s, slot) in enumerate(zip(seqs, slots)):
            start, end, toks = s.num_computed, s.chunk_end, s.tokens
            n = end - start
            t0 = len(ids)
            ids += toks[start:end]
            pos += range(start, end)
            smap += [s.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            tok_slots += [slot] * n
            q_lens.append(n)
            ctx_lens.append(end)
            q_index.append(list(range(t0, t0 + n)) + [-1] * (Lq - n))
            out_index += [b * Lq + i for i in range(n)]
            if self._want_prompt(s):
                logit_rows += range(t0, t0 + n)
            elif end == len(toks):
                logit_rows.append(t0 + n - 1)
        T = len(ids)
        q_index = [[T if i < 0 else i for i in row] for row in q_index]
        W = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (W - len(s.block_table)) for s in seqs]
        ctx_t, q_t = self._t(ctx_lens), self._t(q_lens)
        meta = AttentionMetadata(self._t(smap), self._t(tables), self._t(q_index), self._t(out_index),
                                 additive_mask(build_mask(ctx_t, q_t, Lq, W * bs), self.dtype))
        seg = self.segmented_prefill
        if not seg and self.plan.routing.masked_by_padded_row:  # packed row t read as padded row t // Lq
            tok_slots = [slots[min(t // Lq, len(seqs) - 1)] for t in range(T)]
        tok_slots = self.plan.routing.by_position(tok_slots, pos)
        slots_t = self._t(tok_slots)
        rows_t = self._t(logit_rows)
        lora = self.lora_batch(slots_t, segments_of(tok_slots) if seg else None)
        lora_logits = self.logits_batch(lora, rows_t, [tok_slots[r] for r in logit_rows] if seg else None)
        logits = self.model(self._t(ids), self._t(pos), meta, lora, rows_t, lora_logits)
        k = max(max(s.top_k for s in seqs), 1)
        top_ids, top_lp = [], []
        if logit_rows:
            _, top_ids, top_lp = greedy_with_topk(logits, k)
            top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        out: dict[int, StepOutput] = {}
        r = 0
        for s in seqs:
            final = s.chunk_end == len(s)
            want_prompt = self._want_prompt(s)
            n = s.chunk_end - s.num_computed if want_prompt else int(final)
            rows = [list(zip(top_ids[r + i][: s.top_k], top_lp[r + i][: s.top_k])) for i in range(n)]
            if final:
                out[s.seq_id] = (top_ids[r + n - 1][0], rows[-1], rows[:-1] if want_prompt else None)
            else:  # a chunk of a longer prefill: nothing sampled yet
                out[s.seq_id] = (None, None, rows if want_prompt else None)
            r += n
        return out

    @staticmethod
    def _want_prompt(s: Sequence) -> bool:
        return s.want_prompt_logprobs and s.prompt_logprobs is None

    # ---- decode ------------------------------------------------------------------------
    def decode_inputs(self, seqs: list[Sequence]):
        bs = self.block_size
        ids, pos, smap, ctx = [], [], [], []
        for s in seqs:
            n = len(s)
            p = n - 1  # the new token's position: its KV goes to this cache slot
            ids.append(s.last_token)
            pos.append(p)
            smap.append(s.block_table[p // bs] * bs + p % bs)
            ctx.append(n)
        routing = self.plan.routing
        return ids, pos, smap, ctx, routing.by_position(routing.decode_rows(self.row_slots(seqs)), pos)

    def decode_forward(self, ids, pos, smap, tables, ctx_lens, slots) -> torch.Tensor:
        """Tensor-only decode step (what graphs capture): one query per sequence."""
        mask = decode_mask(ctx_lens, tables.shape[1] * self.block_size, self.dtype)
        meta = AttentionMetadata(smap, tables, None, None, mask)
        lora = self.lora_batch(slots, None)
        return self.model(ids, pos, meta, lora, None, self.logits_batch(lora))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> dict[int, StepOutput]:
        ids, pos, smap, ctx, slots = self.decode_inputs(seqs)
        k = max(max(s.top_k for s in seqs), 1)
        if self.graphs is not None:
            top_ids, top_lp = self.graphs.run(seqs, ids, pos, smap, ctx, slots, k)
        else:
            B, W = len(seqs), max(len(s.block_table) for s in seqs)
            host = ids + pos + smap + ctx + slots
            for s in seqs:
                host += s.block_table
                host += [0] * (W - len(s.block_table))
            flat = self._t(host)  # one host->device copy for every input
            cols = flat[: 5 * B].view(5, B)
            logits = self.decode_forward(cols[0], cols[1], cols[2], flat[5 * B:].view(B, W), cols[3], cols[4])
            _, top_ids, top_lp = greedy_with_topk(logits, k)
        top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        out: dict[int, StepOutput] = {}
        for s, i_row, lp_row in zip(seqs, top_ids, top_lp):
            kk = s.top_k
            out[s.seq_id] = (i_row[0], list(zip(i_row[:kk], lp_row[:kk])), None)
        return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def build_rank(model_dir, device: str, dtype: str, cfg, tp=None):
    """One rank's share of an engine: (plan, spec, fused kernels on?, KV blocks, model runner). The
    runner holds the model (``runner.model``); with ``tp`` (layers/parallel.py), this rank's shards."""
    from lora_conformance.checkpoints import torch_dtype
    from lora_conformance.engines.builtin.engine.plan import EnginePlan
    from lora_conformance.engines.builtin.layers import kernels
    from lora_conformance.engines.builtin.models.config import load_spec
    from lora_conformance.engines.builtin.models.loader import build_model

    tdt = torch_dtype(dtype)
    plan = EnginePlan.decide(cfg, device, tdt)  # fault, variant, LoRA path: decided once
    spec = load_spec(model_dir)
    max_len = max(cfg.max_model_len, 16)
    model = build_model(model_dir, spec, max_len, device, tdt, plan.rope_exponent_dim, tp, plan.quant)
    # compile mode: inductor fuses the decode step itself (the hand-written Triton kernels stay eager's)
    fused = kernels.select(device, "torch" if cfg.decode_mode == "compile" else cfg.kernels)
    kernels.attach(model, fused)
    bs = cfg.kv_block_size
    num_blocks = cfg.num_kv_blocks or 1 + cfg.max_batch_size * ((min(max_len, 1024) + bs - 1) // bs)
    return plan, spec, fused, num_blocks, ModelRunner(model, spec, cfg, plan, device, tdt, num_blocks)


def _first_slot(slots: torch.Tensor) -> torch.Tensor:
    """Every adapter row's slot replaced by slot 0 (base rows, -1, stay base)."""
    return torch.where(slots >= 0, torch.zeros_like(slots), slots)
