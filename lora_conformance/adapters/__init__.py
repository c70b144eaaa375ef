"""Known-weight LoRA adapters for the suites: specs, synthesis into PEFT directories, a cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
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
    """sha256 over the adapter files' bytes (config and weights)."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        p = Path(path) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def synthesize_cached(base_dir: Union[str, Path], spec: AdapterSpec, cache_dir: Union[str, Path]) -> Path:
    """``synthesize_adapter`` into a content-addressed dir (base model hash + spec); safe across processes."""
    from filelock import FileLock

    from lora_conformance.models import content_hash
    from lora_conformance.adapters import synth

    key = hashlib.sha256(
        f"{content_hash(base_dir)}:{spec.cache_key()}:{synth.CODE_VERSION}".encode()
    ).hexdigest()[:20]
    root = Path(cache_dir) / "adapters"
    final = root / key
    if all((final / f).is_file() for f in ADAPTER_FILES):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{key}.lock")):
        if all((final / f).is_file() for f in ADAPTER_FILES):
            return final
        from lora_conformance.reference.cache import remove_stale_temps

        remove_stale_temps(root, f".{key}.", max_age_s=0)  # under the lock: a killed synthesis's leftovers
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            synthesize_adapter(Path(base_dir), spec, tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
