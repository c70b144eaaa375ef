"""Decode under captured device graphs or torch.compile, through the device layer.

exec_mode=compile runs the same padded step through ``torch.compile`` instead of a capture (any
device with an inductor backend, cpu included); everything below about buffers and padding holds
for it too.

One graph per (padded batch size, padded block-table width, LoRA layout, top-k). The graph
runs the sampler too (greedy token and top-k logprobs), so a step is one replay and one
device->host copy, with no eager launches around it. Inputs live in
static buffers that every replay overwrites -- including the per-row adapter slot indices,
which is exactly what fault ``graph_stale_indices`` forgets to do. Padding rows write
their KV into scratch block 0 and use slot -1 (base).
"""

from __future__ import annotations

import torch

from lora_conformance import devices
from lora_conformance.engines.builtin.layers.sampler import greedy_with_topk

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The compiled step pads a batch of one to two rows: dynamo specialises a dynamic size on the values
# 0 and 1, so a one-row step would compile the whole decoder a second time (one graph serves the rest).
COMPILED_BUCKETS = BATCH_BUCKETS[1:]


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    return n


class DecodeGraphs:
    def __init__(self, runner, compiled: bool = False):
        self.runner = runner
        self.device = runner.device
        self.graphs: dict[tuple, tuple] = {}
        self.compiled = None
        # Why the step could not compile as one graph, where it could not (a RuntimeWarning says it too).
        self.graph_break: "str | None" = None
        self._resumable = None
        if compiled:
            import torch._dynamo

            # Every new bucket, layout or LoRA signature recompiles; past the limit dynamo would fall
            # back to eager without a word, and the mode would no longer be what it says.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4096)
            # dynamic: one graph for every batch bucket and block-table width (not one compile each).
            # fullgraph: the step compiles as one graph, or says where it breaks (_compiled_step).
            self._whole = torch.compile(self._flat_step, dynamic=True, fullgraph=True)
            self.compiled = self._compiled_step
        self.buckets = COMPILED_BUCKETS if compiled else BATCH_BUCKETS
        self.pool = devices.graph_pool_handle(self.device) if not compiled else None
        self.max_width = (runner.args.max_model_len + runner.block_size - 1) // runner.block_size

    def _compiled_step(self, *args):
        """The step as one compiled graph; where dynamo cannot trace it whole (a graph break: torch
        2.11 broke inside the LoRA routing), a warning naming the break, and the step compiled in
        pieces from then on. Pieces cost more: the frame resumed after a break takes views of the flat
        buffer as inputs, whose storage offsets (multiples of the bucket) duck sizing takes to equal
        any size of the same value (16, the KV block), so buckets 4, 16 and 2 each compile the rest of
        the decoder again (seven graphs, the full profile's compile case 311.8 s on an H100). Turning
        duck sizing off avoids those recompiles but costs more than they do: symbolic reasoning over
        a deep decoder then grows faster than its depth (bench/compile_depth.py, one graph of 16
        layers on cpu: 78 s with duck sizing, 300 s without; with the break forced there, 97 s with
        it in five graphs, 260 s without in four; the 28-layer full profile's case, compiled
        without it, no longer finished on an H100). Tracing fails before the step runs anything, so
        the buffers the step writes are untouched when the fallback runs it."""
        if self._resumable is None:
            try:
                return self._whole(*args)
            except torch._dynamo.exc.Unsupported as e:
                import warnings

                said = str(e).strip()
                self.graph_break = said.splitlines()[0][:300] if said else type(e).__name__
                warnings.warn(f"exec_mode=compile: the decode step does not compile as one graph "
                              f"({self.graph_break}); it is compiled in pieces from here on", RuntimeWarning,
                              stacklevel=2)
                self._resumable = torch.compile(self._flat_step, dynamic=True)
        return self._resumable(*args)

    def _widths(self):
        w, out = 4, []
        while w < self.max_width:
            out.append(w)
            w *= 2
        return out + [self.max_width]

    def _buffers(self, B: int, W: int) -> dict:
        # One flat int64 buffer, so each replay needs a single host->device copy.
        flat = torch.zeros(B * (5 + W), dtype=torch.long, device=self.device)
        cols = flat[: 5 * B].view(5, B)
        return {"flat": flat, "ids": cols[0], "pos": cols[1], "smap": cols[2], "ctx": cols[3], "slots": cols[4],
                "tables": flat[5 * B:].view(B, W)}

    def _step(self, ids, pos, smap, tables, ctx, slots, k: int):
        logits = self.runner.decode_forward(ids, pos, smap, tables, ctx, slots)
        _, top_ids, top_lp = greedy_with_topk(logits, k)
        return top_ids, top_lp

    def _flat_step(self, flat, B: int, W: int, k: int, apply_lora: bool):
        """``_step`` on the one flat buffer, sliced inside the compiled region. Its six inputs are
        views of one storage; handed to torch.compile as six aliased inputs, AOT autograd merges them
        into a synthetic base, which failed under dynamic shapes on an H200 (torch 2.11: "Expected
        !size_bytes_is_heap_allocated_", in 9 tests' first compile)."""
        cols = flat[: 5 * B].view(5, B)
        slots = cols[4] if apply_lora else torch.full_like(cols[4], -1)  # not apply_lora: the fault
        return self._step(cols[0], cols[1], cols[2], flat[5 * B:].view(B, W), cols[3], slots, k)

    def _capture(self, bufs: dict, k: int):
        """Capture with the current batch already in the buffers (the warm-up step writes the
        same KV values the replay will write)."""
        dev = self.device

        def fn():
            return self._step(bufs["ids"], bufs["pos"], bufs["smap"], bufs["tables"], bufs["ctx"], bufs["slots"], k)

        side = devices.new_stream(dev)
        side.wait_stream(devices.current_stream(dev))
        with devices.stream_context(dev, side):
            fn()  # warm-up outside capture (lazy inits, allocator)
        devices.current_stream(dev).wait_stream(side)
        graph = devices.new_graph(dev)
        with devices.graph_capture(dev, graph, pool=self.pool):
            out = fn()
        return graph, out

    def run(self, seqs, ids, pos, smap, ctx, slots, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k ids, top-k logprobs) of this decode step, (len(seqs), k) each, on the device."""
        r = self.runner
        n = len(seqs)
        B = _bucket(n, self.buckets)
        W = _bucket(max(len(s.block_table) for s in seqs), self._widths())
        key = (B, W, r.layout_version, r.lora_signature, k)
        entry = self.graphs.get(key)
        if entry is None:
            kept = {g: v for g, v in self.graphs.items() if g[2:4] == key[2:4]}  # drop stale layouts
            if len(kept) < len(self.graphs) and self.compiled is None:
                # A pool is released with the last graph captured into it: never capture into a
                # handle whose graphs were all dropped (the allocator asserts on the double release).
                self.pool = devices.graph_pool_handle(self.device)
            self.graphs = kept
            entry = self.graphs[key] = {"bufs": self._buffers(B, W), "graph": None}
        pad = B - n
        slot_row = slots + [-1] * pad
        if not r.plan.graphs_refresh_slots and entry["graph"] is not None:
            slot_row = entry["captured_slots"]  # the bug: indices frozen at capture time
        zeros = [0] * pad
        host = ids + zeros
        host += pos
        host += zeros
        host += smap
        host += zeros
        host += ctx
        host += [1] * pad
        host += slot_row
        for s in seqs:
            host += s.block_table
            host += [0] * (W - len(s.block_table))
        host += [0] * (W * pad)
        entry["bufs"]["flat"].copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)
        if self.compiled is not None:
            top_ids, top_lp = self.compiled(entry["bufs"]["flat"], B, W, k, r.plan.compiled_applies_lora)
            return top_ids[:n], top_lp[:n]
        if entry["graph"] is None:
            entry["graph"], entry["out"] = self._capture(entry["bufs"], k)
            entry["captured_slots"] = slot_row
        entry["graph"].replay()
        top_ids, top_lp = entry["out"]
        return top_ids[:n], top_lp[:n]
