"""BuiltinEngine: the project's own multi-LoRA serving engine behind the Engine interface."""

from __future__ import annotations

import functools
import weakref
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from lora_conformance import devices
from lora_conformance.checkpoints import DTYPE_NAMES, torch_dtype
from lora_conformance.engines.args import Rename
from lora_conformance.engines.base import Capability, Engine, EngineFailure, Limits, UnsupportedFeatureError
from lora_conformance.engines.builtin.args import EngineArgs
from lora_conformance.engines.builtin.models.config import load_spec
from lora_conformance.types import GenerationRequest, GenerationResult

# torch and the engine's parts are imported when an engine is created, not with the class: the
# plugin reads the class's declarations (args, capabilities) before any test, and fast.


def _inference_mode(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class BuiltinEngine(Engine):
    name = "builtin"
    Args = EngineArgs
    standard_args = {"tensor_parallel": Rename("tensor_parallel_size")}
    requires = ("torch",)
    base_quantizations = {"int8": "its own int8 weight-only linear, per output channel, dequantised in the matmul "
                                  "(layers/int8_linear.py)",
                          "q8_0": "GGUF Q8_0 blocks decoded once at load; activations=int8 reads 8-bit activation "
                                  "blocks in front of them as llama.cpp's CPU kernels do (layers/gguf_base.py)",
                          "q4_k": "GGUF Q4_K blocks decoded once at load; activations=int8 reads 8-bit activation "
                                  "blocks in front of them as llama.cpp's CPU kernels do (layers/gguf_base.py)"}

    @classmethod
    def parse_args(cls, raw, source="the engine's arguments"):
        """A test that asks for standard ``tensor_parallel`` (the tensor-parallel suite's tp=1 and
        tp=2 engines) gets it even where the run's args set ``tensor_parallel_size`` for every engine."""
        if "tensor_parallel" in raw and "tensor_parallel_size" in raw:
            raw = {k: v for k, v in raw.items() if k != "tensor_parallel_size"}
            if not isinstance(source, str):
                source = {k: v for k, v in source.items() if k != "tensor_parallel_size"}
        return super().parse_args(raw, source)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = self.parse_args(self.args)
        import dataclasses

        import torch

        from lora_conformance.engines.builtin.engine.adapter import (SCALING_FIELDS, HostAdapter, load_adapter_dir,
                                                                      model_lora_modules)
        from lora_conformance.engines.builtin.engine.adapter_pool import AdapterPool
        from lora_conformance.engines.builtin.engine.block_manager import BlockManager
        from lora_conformance.engines.builtin.engine.inflight import InflightServer
        from lora_conformance.engines.builtin.engine.llm_engine import LLMEngine
        from lora_conformance.engines.builtin.engine.model_runner import build_rank

        self.device = devices.resolve_device(device or "auto")
        if dtype in (None, "", "auto"):
            dtype = devices.default_dtype_for(self.device)
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype!r}: the builtin engine takes one of {', '.join(DTYPE_NAMES)}")
        self.dtype, self.torch_dtype = dtype, torch_dtype(dtype)
        refused = self._mode_refusal(self.cfg, self.device)
        if refused:
            raise UnsupportedFeatureError(refused)
        from lora_conformance.models.quant import GGUF_ACTIVATIONS

        # (an encoder base is never quantised: --base-quant snaps decoders; it runs float whatever activations says)
        if (self.cfg.activations != "float" and self.base_quant not in GGUF_ACTIVATIONS
                and load_spec(self.model_dir).kind != "encoder"):
            raise UnsupportedFeatureError(f"engine 'builtin': activations={self.cfg.activations} quantises the "
                                          f"activations in front of a GGUF base's quantised matmuls; this base is "
                                          f"{self.base_quant!r} (use --base-quant {' or '.join(GGUF_ACTIVATIONS)})")
        if self.base_quant != "none" and self.cfg.tensor_parallel_size > 1:
            raise UnsupportedFeatureError(f"engine 'builtin': a {self.base_quant} base with tensor_parallel_size > 1 "
                                          "(the shards are not cut from int8 codes)")
        self.workers = None
        if self.cfg.tensor_parallel_size > 1:
            plan, self.spec, self.fused_kernels, num_blocks, runner = self._start_ranks()
        else:
            plan, self.spec, self.fused_kernels, num_blocks, runner = build_rank(self.model_dir, self.device, dtype,
                                                                                self.cfg)
        self.plan, self.model = plan, runner.model
        from lora_conformance.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_dir)
        bs = self.cfg.kv_block_size
        self._modules = model_lora_modules(self.model)
        pin = devices.pin_memory_supported(self.device)
        first_scaling: dict[str, dict] = {}  # name -> its first load's scaling fields (read only under a fault)
        by_path: dict[str, HostAdapter] = {}  # directory -> its first read (only under a fault)

        def read(n, p, pinned):
            where = str(Path(p).resolve()) if plan.cache_by_path else ""
            if where in by_path:  # the fault adapter_cache_keyed_by_path
                return dataclasses.replace(by_path[where], name=n)
            keep = None
            if not plan.reload_reads_scaling:  # the fault reload_keeps_first_scaling
                from lora_conformance.checkpoints import read_adapter_config

                cfg = read_adapter_config(p)
                keep = first_scaling.setdefault(n, {k: cfg[k] for k in SCALING_FIELDS if k in cfg})
            adapter = load_adapter_dir(n, p, self._modules, self.cfg.max_rank, plan.adapters, self.torch_dtype, pin,
                                       self.model_dir, keep)
            if where:
                by_path[where] = adapter
            return adapter

        self.pool = AdapterPool(self.cfg.max_loras_per_batch, self.cfg.max_loaded_loras, self.cfg.eviction, read,
                                plan.reload_reads_weights, plan.evict_pinned, plan.unload_frees_path)
        self.runner = runner
        self.blocks = BlockManager(num_blocks, bs, self.cfg.prefix_cache, plan.prefix_salt)
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.llm = LLMEngine(self.runner, self.pool, self.blocks, self.tokenizer, self.cfg, eos, plan)
        self.server = InflightServer(self.llm, plan.drain_before_change)  # one step, admission or adapter change at a time
        self.capabilities = self._capabilities(self.cfg, self.spec.kind)
        self.limits = self.declared_limits(self.cfg, self.model_dir, self.device)

    def _start_ranks(self):
        """Spawn ranks 1.., meet them, build rank 0's shard here; a worker that fails to start fails this."""
        from lora_conformance.engines.builtin.engine.model_runner import build_rank
        from lora_conformance.engines.builtin.engine.workers import STARTUP_TIMEOUT_S, RankZeroRunner, Workers, connect
        from lora_conformance.engines.builtin.layers.parallel import check_shardable

        size = self.cfg.tensor_parallel_size
        check_shardable(load_spec(self.model_dir), size)
        kind = devices.device_type(self.device)
        if kind != "cpu":
            index = int(self.device.partition(":")[2] or 0)
            if index + size > devices.device_count(kind):
                raise UnsupportedFeatureError(f"tensor_parallel_size={size} from {self.device} needs {index + size} "
                                              f"{kind} devices, this machine has {devices.device_count(kind)}")
        self.workers = Workers(size)
        self._stop_workers = weakref.finalize(self, self.workers.stop)  # never an orphan, closed or not
        self.workers.start(self.model_dir, self.device, self.dtype, self.cfg)
        try:
            tp, control = connect(self.workers.store_path, 0, size, self.device, STARTUP_TIMEOUT_S)
            self.workers.control = control
        except BaseException:
            self._stop_workers()
            raise
        try:
            built = build_rank(self.model_dir, self.device, self.dtype, self.cfg, tp)
        except BaseException:
            control.all_ready(False)
            self._stop_workers()
            raise
        if not control.all_ready(True):
            self._stop_workers()
            raise EngineFailure(f"a tensor-parallel worker of {size} ranks failed to start (its traceback is on stderr)")
        *head, runner = built
        return (*head, RankZeroRunner(runner, control))

    @classmethod
    def declared_capabilities(cls, cfg: EngineArgs, model_dir: Optional[Path], device: str):
        """None where the engine would refuse to start (an unknown architecture, graphs on a device
        without them): the started engine says why."""
        if cls._mode_refusal(cfg, devices.resolve_device(device or "auto")):
            return None
        try:
            kind = "decoder" if model_dir is None else load_spec(Path(model_dir)).kind
        except (UnsupportedFeatureError, OSError, ValueError, KeyError):
            return None
        return cls._capabilities(cfg, kind)

    @classmethod
    def declared_activations(cls, cfg: EngineArgs, model_dir: Optional[Path], device: str,
                             dtype: Optional[str] = None) -> Optional[str]:
        """With activations=int8 on a GGUF base: the activation blocks its quantised matmuls read."""
        from lora_conformance.models.quant import gguf_activations

        return None if cfg.activations == "float" else gguf_activations(model_dir)

    @staticmethod
    def _mode_refusal(cfg: EngineArgs, device: str) -> Optional[str]:
        """Why the engine refuses its execution mode on ``device`` (None: it serves it)."""
        mode = cfg.decode_mode
        if mode == "graphs" and not devices.graphs_supported(device):
            return f"engine arg graphs=1 / exec_mode=graphs: graph capture is not supported on {device}; use eager"
        if mode != "eager" and cfg.tensor_parallel_size > 1:
            return (f"exec_mode={mode} with tensor_parallel_size > 1: the builtin engine compiles and captures "
                    "decode on one device only; use eager")
        return None

    @classmethod
    def exec_modes(cls, device_type: str) -> dict:
        """The execution modes the engine declares on this device type (engine arg -> values): a
        certification covers each (suites/test_runtime_modes.py, bench/certify_modes.py)."""
        from lora_conformance.engines.builtin.args import EXEC_MODES

        # compile where inductor emits Triton (an accelerator); on cpu it compiles C++ with the host
        # compiler, minutes per engine on a small machine: exec_mode=compile runs there, undeclared.
        declared = {"eager": True, "compile": devices.triton_backend(device_type),
                    "graphs": devices.graphs_supported(device_type)}
        return {"exec_mode": tuple(m for m in EXEC_MODES if declared[m])}

    @classmethod
    def declared_limits(cls, cfg: EngineArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(cfg.max_loras_per_batch, cfg.max_loaded_loras, cfg.max_rank)

    @staticmethod
    def _capabilities(cfg: EngineArgs, kind: str) -> frozenset:
        C = Capability
        caps = {C.DYNAMIC_LOADING, C.PINNING, C.EVICTION_LRU, C.EVICTION_FIFO, C.MAX_LOADED, C.RSLORA,
                C.RANK_PATTERN}
        if cfg.overlap_loading:
            caps.add(C.OVERLAP_LOADING)
        if kind == "encoder":
            return frozenset(caps | {C.EMBEDDINGS, C.MIXED_BATCH})  # embed() takes one adapter per text
        caps |= {C.MIXED_BATCH, C.EMBED_TOKENS, C.LM_HEAD, C.PROMPT_LOGPROBS, C.CHUNKED_PREFILL,
                 C.INFLIGHT_LIFECYCLE, C.TENSOR_PARALLEL}
        if cfg.prefix_cache:
            caps.add(C.PREFIX_CACHE)
        if kind == "moe":
            caps.add(C.MOE)
        if cfg.decode_mode == "graphs" and kind == "decoder":
            caps.add(C.GRAPHS)
        return frozenset(caps)

    @classmethod
    def backends(cls, device_type: str):
        from lora_conformance.engines.builtin.args import LORA_BACKENDS

        return {"lora_backend": LORA_BACKENDS}

    # ---- adapters --------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        """Waits for running requests that use ``name`` (they keep the weights they started with);
        register() reads and validates before it changes anything: a refused load is a no-op."""
        from lora_conformance.adapters.validate import validate_name

        name = validate_name(name)
        self.server.change_adapter(name, lambda: self.pool.register(name, Path(path), pinned))

    def unload_adapter(self, name: str) -> None:
        """Waits for running requests that use ``name``; the freed slots are zeroed."""
        def unload():
            for slot in self.pool.unregister(name):
                self.runner.clear_slot(slot)
        self.server.change_adapter(name, unload)

    def list_adapters(self) -> list[str]:
        return self.pool.names()

    def engine_adapters(self) -> list[str]:
        return self.pool.names()  # the engine's own registry: there is no plugin layer between

    def resident_adapters(self) -> list[str]:
        """Names whose weights are in the host cache (eviction order: first = next victim under lru)."""
        return list(self.pool.host)

    def slot_adapters(self) -> list[Optional[str]]:
        return [s.name for s in self.pool.slots]

    # ---- inference -------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self.spec.kind == "encoder":
            raise UnsupportedFeatureError(f"{self.model_dir} is an encoder: use embed(), not generate()")
        requests = list(requests)
        if self.plan.one_at_a_time:
            return [out for r in requests for out in self.server.generate([r])]
        return self.server.generate(requests)

    def submit(self, requests: Sequence[GenerationRequest]):
        if self.spec.kind == "encoder":
            raise UnsupportedFeatureError(f"{self.model_dir} is an encoder: use embed(), not submit()")
        return self.server.submit(list(requests))

    @_inference_mode
    def embed(self, texts: Sequence[str],
              adapter: Union[None, str, Sequence[Optional[str]]] = None) -> list[list[float]]:
        """Embeddings of ``texts``; ``adapter`` is one name (or None) for all, or one per text
        (mixed batch: each text's rows routed to its adapter's slot)."""
        if self.spec.kind != "encoder":
            raise UnsupportedFeatureError(f"{self.model_dir} is a decoder: the builtin engine embeds with encoders only")
        texts = list(texts)
        names = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(texts)
        if len(names) != len(texts):
            raise ValueError(f"embed: {len(names)} adapters for {len(texts)} texts; give one name or one per text")
        for n in names:
            if n is not None:
                self.pool.check(n)  # AdapterNotLoadedError before any work
        order = list(range(len(texts)))
        if self.plan.reverse_order:
            order.reverse()
        with self.server._locked():  # slots are not reassigned under a running step
            return self._embed_locked(texts, names, order)

    def _embed_locked(self, texts: list[str], names: list, order: list[int]) -> list[list[float]]:
        out: list[Optional[list[float]]] = [None] * len(texts)
        batch: list[int] = []
        locked: set[str] = set()
        slots: list[int] = []
        for i in order:
            n = names[i]
            full = batch and (self.plan.one_at_a_time or len(batch) >= self.cfg.max_batch_size
                              or (n is not None and not self.pool.can_assign(n, locked)))
            if full:  # this text's adapter needs a slot a text of the batch holds: run the batch first
                self._embed_batch(texts, batch, slots, out)
                batch, locked, slots = [], set(), []
            slots.append(-1 if n is None else self.pool.assign(n, locked))
            if n is not None:
                locked.add(n)
            batch.append(i)
        if batch:
            self._embed_batch(texts, batch, slots, out)
        return out

    def _embed_batch(self, texts: list[str], index: list[int], slots: list[int], out: list) -> None:
        """One encoder forward over texts[index], text k's tokens routed to slots[k]."""
        self.runner.load_slots(self.pool.pending_copies())
        self.tokenizer.padding_side = "right"  # absolute positions: padding must come last
        enc = self.tokenizer([texts[i] for i in index], padding=True, truncation=True,
                             max_length=self.spec.max_position_embeddings, return_tensors="pt")
        ids, attn = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        import torch

        rows = torch.tensor(self.runner.embed_row_slots(slots), dtype=torch.long, device=self.device)
        token_slots = rows.repeat_interleave(ids.shape[1])  # ids (B, L) row-major: L tokens per text
        vecs = self.model(ids, attn, self.runner.lora_batch(token_slots, None)).cpu().tolist()
        for i, v in zip(index, vecs):
            out[i] = v

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("lora-conformance")
        except PackageNotFoundError:
            v = "0+unknown"
        return f"lora-conformance builtin {v} (kernels: {'triton' if self.fused_kernels else 'torch'})"

    def settings(self) -> dict:
        """The effective settings that are not plain engine args (those are in the report already)."""
        tp = self.cfg.tensor_parallel_size
        return {"effective": {
            "tensor_parallel_size": tp,
            "collective_backend": devices.collective_backend(self.device) if tp > 1 else None,
            "ranks": "rank 0 in the engine's process, ranks 1.. spawned workers" if tp > 1 else "one process",
            "prefill_lora_path": "segmented" if self.plan.segmented_prefill else "masked",
            "kernels": "triton" if self.fused_kernels else "torch",
            "exec_mode": self.cfg.decode_mode,
            "dtype": self.dtype,
            "fault": self.plan.fault,
            "variant": str(self.plan.variant),
        }}

    def close(self) -> None:
        """Stop serving, let go of everything that holds the model, its KV cache or adapter buffers
        (the PEFT engine's close does the same), and free them now. The model is a graph of
        reference cycles (each LoraLinear and its LinearGroup point at each other; the adapter
        pool's reader closes over this engine), so its memory goes back only when the cyclic
        collector runs, which in a process with large heaps can be several engines later: at real
        shapes closed engines (GBs each) piled up until the host ran out of memory. The freed pages
        then go back to the system (parallel.release_freed_memory)."""
        from lora_conformance import parallel

        if getattr(self, "server", None) is not None:
            self.server.close()
        if getattr(self, "workers", None) is not None:
            self._stop_workers()
        self.server = self.llm = self.pool = self.blocks = self.runner = self.model = self._modules = None
        parallel.release_freed_memory()
