"""The built-in engine's arguments, declared once (``--engine-arg KEY=VALUE``; see engines/args.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lora_conformance.engines.args import arg, parse_engine_args
from lora_conformance.engines.builtin.faults import Faults
from lora_conformance.engines.builtin.variants import Variant

# How prefill routes rows to LoRA slots (layers/lora.py): one shrink/expand per adapter segment,
# or every slot at once with a per-row mask (the path decode always takes).
LORA_BACKENDS = ("segmented", "masked")
KERNEL_MODES = ("auto", "torch", "triton")  # fused decode kernels (layers/kernels.py)
# How decode steps execute (engine/graph_runner.py): eager; torch.compile of the decode step; captured
# device graphs. compile and graphs pad a step's batch to BATCH_BUCKETS; prefill is eager in every mode.
EXEC_MODES = ("eager", "compile", "graphs")
# What the quantised matmuls of a GGUF base read (layers/gguf_base.py): float; int8 (ggml's quantisers);
# int8_alt (another correct quantiser of the same blocks: a negative control of the rows for 8-bit activations).
ACTIVATIONS = ("float", "int8", "int8_alt")


def _fault(value: Optional[str]) -> Optional[str]:
    return Faults(value).name  # validates against the catalogue


@dataclass(frozen=True)
class EngineArgs:
    # The standard args (their meaning: engines/args.py STANDARD_ARGS), honoured as named.
    max_loras_per_batch: int = arg(4, minimum=1)
    max_loaded_loras: int = arg(8, minimum=1)
    max_rank: int = arg(64, minimum=1)
    eviction: str = arg("lru", choices=("lru", "fifo"))
    prefix_cache: bool = arg(True)
    overlap_loading: bool = arg(True)
    graphs: bool = arg(False)
    exec_mode: str = arg("eager", "decode execution: eager; compile (torch.compile of the decode step, batches "
                                  "padded to buckets, inductor's fusion instead of the fused kernels); graphs "
                                  "(captured device graphs, padded; the same as graphs=1)", choices=EXEC_MODES)
    chunked_prefill_size: int = arg(0, "prefill tokens per step (a longer prompt takes several steps); 0: unchunked",
                                    minimum=0)
    lora_backend: str = arg("auto", "prefill LoRA path: segmented, masked; auto: segmented on cpu, masked elsewhere",
                            choices=("auto",) + LORA_BACKENDS)
    tensor_parallel_size: int = arg(1, "ranks the model and its LoRA are sharded over (standard arg tensor_parallel, "
                                       "which wins where both are given); cpu: gloo processes, accelerators: one "
                                       "device each", minimum=1)
    # The engine's own.
    kv_block_size: int = arg(16, "tokens per KV-cache block", minimum=1)
    num_kv_blocks: Optional[int] = arg(None, "KV-cache blocks (default: sized from max_batch_size x max_model_len)",
                                       minimum=2)
    max_batch_size: int = arg(64, "requests decoded together", minimum=1)
    max_model_len: int = arg(2048, "the longest sequence (prompt + generated tokens)", minimum=2)
    fault: Optional[str] = arg(None, "a deliberate bug from the fault catalogue (engines/builtin/faults.py), "
                                     "to show the suites catch it", check=_fault)
    kernels: str = arg("auto", "fused decode kernels: auto (triton on cuda/xpu), torch, triton", choices=KERNEL_MODES)
    variant: Variant = arg(Variant(), "a benign variation (engines/builtin/variants.py), for negative controls",
                           check=Variant.parse)
    activations: str = arg("float", "what a GGUF base's quantised matmuls read: float; int8 (each activation row "
                                    "quantised to 8-bit blocks first, as llama.cpp's CPU kernels do: Q8_0 in front of "
                                    "q8_0 weights, Q8_K in front of q4_k; the LoRA reads float; layers/gguf_base.py); "
                                    "int8_alt (the same blocks rounded otherwise: a negative control)",
                           choices=ACTIVATIONS)

    @property
    def decode_mode(self) -> str:
        """The decode execution mode in effect: graphs where the standard arg graphs=1 asks for it."""
        return "graphs" if self.graphs else self.exec_mode

    def __post_init__(self) -> None:
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"engine arg max_loaded_loras={self.max_loaded_loras} must be >= "
                             f"max_loras_per_batch={self.max_loras_per_batch}")

    @classmethod
    def parse(cls, args: Mapping[str, Any], source: Any = "the engine's arguments") -> "EngineArgs":
        return parse_engine_args(cls, args, source, engine="builtin")
