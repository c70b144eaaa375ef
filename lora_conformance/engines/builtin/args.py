"""``--engine-arg KEY=VALUE`` strings -> validated settings of the built-in engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from lora_conformance.engines.builtin.faults import Faults
from lora_conformance.engines.builtin.variants import Variant

# How prefill routes rows to LoRA slots (layers/lora.py): one shrink/expand per adapter segment,
# or every slot at once with a per-row mask (the path decode always takes).
LORA_BACKENDS = ("segmented", "masked")


def _int(key: str, value: str, minimum: int) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"engine arg {key}={value!r}: expected an integer >= {minimum}") from None
    if v < minimum:
        raise ValueError(f"engine arg {key}={value!r}: expected an integer >= {minimum}")
    return v


def _bool(key: str, value: str) -> bool:
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"engine arg {key}={value!r}: expected 1 or 0")


@dataclass
class EngineArgs:
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 8
    max_rank: int = 64
    eviction: str = "lru"
    prefix_cache: bool = True
    overlap_loading: bool = True
    graphs: bool = False
    kv_block_size: int = 16
    num_kv_blocks: Optional[int] = None  # None: sized from max_batch_size * max_model_len
    max_batch_size: int = 64
    max_model_len: int = 2048
    fault: Optional[str] = None
    kernels: str = "auto"  # fused decode kernels: auto (triton on cuda/xpu), torch, triton
    variant: Variant = Variant()  # a benign variation (variants.VARIANTS), for negative controls
    chunked_prefill_size: int = 0  # prefill tokens per step (a longer prompt takes several steps); 0: unchunked
    lora_backend: str = "auto"  # prefill LoRA path: segmented, masked; auto: segmented on cpu, masked elsewhere

    @classmethod
    def parse(cls, args: Mapping[str, str]) -> "EngineArgs":
        out = cls()
        ints = {"max_loras_per_batch": 1, "max_loaded_loras": 1, "max_rank": 1, "kv_block_size": 1,
                "num_kv_blocks": 2, "max_batch_size": 1, "max_model_len": 2, "chunked_prefill_size": 0}
        bools = ("prefix_cache", "overlap_loading", "graphs")
        for key, value in args.items():
            if key in ints:
                setattr(out, key, _int(key, value, ints[key]))
            elif key in bools:
                setattr(out, key, _bool(key, value))
            elif key == "eviction":
                if value not in ("lru", "fifo"):
                    raise ValueError(f"engine arg eviction={value!r}: expected lru or fifo")
                out.eviction = value
            elif key == "kernels":
                from lora_conformance.engines.builtin.layers.kernels import MODES

                if value not in MODES:
                    raise ValueError(f"engine arg kernels={value!r}: expected one of {', '.join(MODES)}")
                out.kernels = value
            elif key == "lora_backend":
                if value not in LORA_BACKENDS + ("auto",):
                    raise ValueError(f"engine arg lora_backend={value!r}: expected auto, {', '.join(LORA_BACKENDS)}")
                out.lora_backend = value
            elif key == "fault":
                out.fault = Faults(value).name  # validates against the catalogue
            elif key == "variant":
                out.variant = Variant.parse(value)  # validates against variants.VARIANTS
            else:
                known = sorted([*ints, *bools, "eviction", "fault", "kernels", "lora_backend", "variant"])
                raise ValueError(f"unknown engine arg {key!r} for engine 'builtin'; known: {', '.join(known)}")
        if out.max_loaded_loras < out.max_loras_per_batch:
            raise ValueError(
                f"engine arg max_loaded_loras={out.max_loaded_loras} must be >= "
                f"max_loras_per_batch={out.max_loras_per_batch}"
            )
        return out
