"""Known-weight LoRA adapters for the suites: specs, synthesis into PEFT directories, a cache."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

from lora_conformance.adapters.spec import (
    BIAS_VALUES,
    MAX_RANK,
    MOE_EXPERT_PARAMETERS,
    TARGET_SETS,
    AdapterSpec,
    resolve_targets,
)
from lora_conformance.adapters.synth import ADAPTER_FILES, B_STD, synthesize_adapter
from lora_conformance.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS

# Distinct q/v adapters used by the suites. Seeds were picked by scanning (bench/model_margins.py
# --scan): a random q/v adapter has bf16 or fp16 diverge from fp32 on >= 1 of the 16 default
# prompts about 80% of the time (24 rank-8 seeds: 3 clean; 12 rank-16 seeds: 7 clean), because
# its perturbation of the votes is continuous. These four are clean, change greedy output within
# 4 tokens on >= 10/16 prompts, and keep every fp32 top-1/top-2 margin >= MIN_MARGIN.
# Measured (16 prompts x 16 steps): min margin / prompts changed by step 4:
#   A 0.018 / 13, B 0.014 / 14, C 0.040 / 10, D 0.024 / 11.
DEFAULT_ADAPTERS: dict[str, AdapterSpec] = {
    "A": AdapterSpec(seed=9),
    "B": AdapterSpec(seed=19),
    "C": AdapterSpec(seed=33, rank=16),
    "D": AdapterSpec(seed=37, rank=16),
}
# nats. The base model's bound is far larger (>= 1.0, measured 1.45); adapters are the weak spot.
MIN_MARGIN = 0.01

__all__ = [
    "ADAPTER_FILES",
    "B_STD",
    "BIAS_VALUES",
    "DEFAULT_ADAPTERS",
    "MAX_RANK",
    "MIN_MARGIN",
    "MOE_EXPERT_PARAMETERS",
    "TARGET_SETS",
    "AdapterSpec",
    "adapter_hash",
    "resolve_targets",
    "synthesize_adapter",
    "synthesize_cached",
]


def adapter_hash(path: Union[str, Path]) -> str:
    """sha256 over the adapter files' bytes (config and weights, safetensors or .bin)."""
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS):
        p = Path(path) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def synthesize_cached(base_dir: Union[str, Path], spec: AdapterSpec, cache_dir: Union[str, Path]) -> Path:
    """``synthesize_adapter`` into a content-addressed dir (base model hash + spec); safe across processes."""
    from lora_conformance.adapters import synth
    from lora_conformance.fileio import build_directory_once
    from lora_conformance.models import content_hash

    key = hashlib.sha256(
        f"{content_hash(base_dir)}:{spec.cache_key()}:{synth.CODE_VERSION}".encode()
    ).hexdigest()[:20]
    return build_directory_once(Path(cache_dir) / "adapters" / key,
                                lambda d: all((d / f).is_file() for f in ADAPTER_FILES),
                                lambda tmp: synthesize_adapter(Path(base_dir), spec, tmp))
