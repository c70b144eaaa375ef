"""Known-weight LoRA adapters, written as ordinary PEFT directories.

PEFT builds the module tree and the config (so key names and config fields are PEFT's
own); we then overwrite every adapter tensor with values drawn from a generator seeded by
``spec.seed`` and a stable per-tensor offset, so the same spec gives the same bytes.

Calibration of B's std (``python bench/model_margins.py --scan 24`` on synthetic:llama,
16 default prompts x 16 greedy steps, q/v rank 8, alpha 16): with B std 0.03 a random
adapter changes greedy output within 4 tokens on 10-16 of 16 prompts (median 14); at
0.02 only ~half the prompts change that early. The price is near-ties: median min margin
~0.01 nats, and bf16 diverges from fp32 on 1-5 prompts for ~80% of seeds, hence the
scanned seeds in ``DEFAULT_ADAPTERS``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from lora_conformance.adapters.spec import AdapterSpec, resolve_targets
from lora_conformance.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS

# Default std of B (A is uniform(+-1/sqrt(fan_in)), PEFT's own A init). Chosen so a rank-8
# q/v adapter changes greedy output within 4 tokens on most default prompts.
B_STD = 0.03
CODE_VERSION = 1  # bump when the bytes for a given spec change
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS[0])  # what synthesis writes


def is_base_layer_key(key: str) -> bool:
    """A saved copy of a base weight (``...base_layer.weight``), not a nested LoRA tensor.

    Two target_parameters on one module nest as ``experts.base_layer.lora_A``: keep those.
    """
    head, sep, tail = key.partition(".base_layer.")
    return bool(sep) and "lora_" not in tail


def lora_config(spec: AdapterSpec, base_dir: Path):
    from peft import LoraConfig

    modules, params = resolve_targets(spec, base_dir)
    kw = dict(
        r=spec.rank,
        lora_alpha=spec.alpha,
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        use_dora=spec.use_dora,
        modules_to_save=list(spec.modules_to_save) if spec.modules_to_save else None,
        bias=spec.bias,
        # Synthetic bases have no biases of their own: give the adapter lora_B biases instead.
        lora_bias=spec.bias != "none",
        init_lora_weights=False,
    )
    if spec.layers_to_transform is not None:
        kw["layers_to_transform"] = list(spec.layers_to_transform)
    if modules:
        kw["target_modules"] = list(modules)
    else:
        kw["target_modules"] = []
    if params:
        kw["target_parameters"] = list(params)
    return LoraConfig(**kw)


def _fill(name: str, p: torch.Tensor, spec: AdapterSpec) -> torch.Tensor:
    # A stable per-tensor stream: the same tensor gets the same values whatever else is targeted.
    g = torch.Generator().manual_seed(spec.seed * 2654435761 % (2**31) + zlib.crc32(name.encode()))
    b_std = B_STD if spec.b_std is None else spec.b_std
    for module, std in spec.b_std_pattern:
        if f".{module}." in name:
            b_std = float(std)
    if spec.zero and ("lora_B" in name or "lora_embedding_B" in name):
        return torch.zeros_like(p)
    if "lora_embedding_A" in name:
        return torch.randn(p.shape, generator=g)  # embedding A is a lookup: unit scale
    if "lora_embedding_B" in name:
        return torch.randn(p.shape, generator=g) * b_std
    if "lora_A" in name:
        bound = 1.0 / p.shape[-1] ** 0.5
        return (torch.rand(p.shape, generator=g) * 2 - 1) * bound
    if "lora_B" in name:
        return torch.randn(p.shape, generator=g) * b_std
    if "lora_magnitude_vector" in name:
        # A non-trivial magnitude: DoRA's m rescales rows, so the adapter differs from plain LoRA.
        return p * (1 + 0.1 * torch.randn(p.shape, generator=g))
    if "modules_to_save" in name:
        return p + torch.randn(p.shape, generator=g) * p.std() * 0.5
    if name.endswith("bias"):
        return torch.randn(p.shape, generator=g) * 0.05
    return p


def synthesize_adapter(base_dir: Path, spec: AdapterSpec, out_dir: Path) -> Path:
    """Write adapter_config.json + adapter_model.safetensors for ``spec`` into ``out_dir``."""
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file

    from lora_conformance.models import load_model

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    model = load_model(base_dir, torch.float32)
    peft_model = get_peft_model(model, lora_config(spec, base_dir))
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if p.requires_grad and "magnitude" not in name:
                p.copy_(_fill(name, p, spec))
        if spec.use_dora:
            for mod_name, mod in peft_model.named_modules():
                if hasattr(mod, "lora_magnitude_vector") and "default" in getattr(mod, "lora_magnitude_vector", {}):
                    # Re-derive m for the seeded A/B, then perturb it (seeded).
                    mod.lora_magnitude_vector["default"].update_layer(
                        base_layer=mod.get_base_layer(),
                        lora_A=mod.lora_A["default"].weight,
                        lora_B=mod.lora_B["default"].weight,
                        scaling=mod.scaling["default"],
                    )
                    w = mod.lora_magnitude_vector["default"].weight
                    w.copy_(_fill(mod_name + ".lora_magnitude_vector", w, spec))
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    # Never ship base matrices (ENGINES.md: loaders must skip base_layer keys; we do not rely on it).
    path = out_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    kept = {k: v.contiguous() for k, v in sorted(tensors.items()) if not is_base_layer_key(k)}
    save_file(kept, str(path), metadata={"format": "pt"})
    cfg_path = out_dir / ADAPTER_CONFIG
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = None  # a path would make the bytes machine-dependent
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out_dir / "README.md").unlink(missing_ok=True)
    return out_dir
