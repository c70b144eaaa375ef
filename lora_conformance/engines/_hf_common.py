"""Helpers shared by the engine plugins: dtype names, top-k records, adapter-config checks.

Nothing here imports torch at module level: the vllm/openai/sglang plugins import this
module in processes where torch may be heavy or absent (the openai plugin needs only a
tokenizer), so torch is imported inside the functions that need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from lora_conformance.engines.base import AdapterIncompatibleError, EngineError
from lora_conformance.types import TopK

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise EngineError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def topk_from_logprobs(row, k: int) -> TopK:
    """A 1-D float32 logprob tensor -> {token id: logprob} of its k best, best first.

    Ties are broken by the lower token id (torch.topk's order is unspecified for ties),
    so two engines with bit-identical logits produce identical dicts.
    """
    import torch

    if k <= 0:
        return {}
    k = min(k, row.shape[-1])
    # Over-fetch a little so that ties at the k-th place can be ordered by id.
    vals, ids = torch.topk(row, min(row.shape[-1], k + 8))
    pairs = sorted(zip(vals.tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))[:k]
    return {int(i): float(v) for v, i in pairs}


def trim_topk(entries: Mapping[int, float], k: int) -> TopK:
    """Keep the k best of an engine's logprob dict (vLLM adds the sampled/prompt token)."""
    pairs = sorted(((int(t), float(v)) for t, v in entries.items()), key=lambda p: (-p[1], p[0]))[:k]
    return dict(pairs)


# ---- adapter configs ----------------------------------------------------------------


@dataclass(frozen=True)
class AdapterInfo:
    """The parts of an adapter_config.json that decide whether an engine can serve it."""

    path: Path
    rank: int
    max_rank: int  # over rank_pattern too
    use_dora: bool
    use_rslora: bool
    modules_to_save: tuple[str, ...]
    bias: str  # PEFT's "none" | "all" | "lora_only"
    lora_bias: bool
    target_modules: tuple[str, ...]
    target_parameters: tuple[str, ...]
    has_rank_pattern: bool
    raw: Mapping[str, Any]

    @property
    def targets_embeddings(self) -> bool:
        return any(m.split(".")[-1] in ("embed_tokens", "wte", "word_embeddings") for m in self.target_modules)

    @property
    def targets_lm_head(self) -> bool:
        return any(m.split(".")[-1] == "lm_head" for m in self.target_modules)


def read_adapter_info(path: Path) -> AdapterInfo:
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterIncompatibleError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterIncompatibleError(f"{cfg_file}: unreadable adapter config ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterIncompatibleError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterIncompatibleError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r = int(cfg.get("r", 8))
    pattern = cfg.get("rank_pattern") or {}
    tm = cfg.get("target_modules") or ()
    return AdapterInfo(
        path=path,
        rank=r,
        max_rank=max([r, *(int(v) for v in pattern.values())]),
        use_dora=bool(cfg.get("use_dora")),
        use_rslora=bool(cfg.get("use_rslora")),
        modules_to_save=tuple(cfg.get("modules_to_save") or ()),
        bias=str(cfg.get("bias") or "none"),
        lora_bias=bool(cfg.get("lora_bias")),
        target_modules=(tm,) if isinstance(tm, str) else tuple(tm),
        target_parameters=tuple(cfg.get("target_parameters") or ()),
        has_rank_pattern=bool(pattern or cfg.get("alpha_pattern")),
        raw=cfg,
    )


def load_tokenizer(model_dir: Path):
    from lora_conformance.models.tokenizer import load_tokenizer as load

    return load(model_dir)


def is_encoder_only(model_dir: Path) -> bool:
    """True for checkpoints whose config describes an encoder without an LM head we generate with."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") or []
    if any("CausalLM" in a for a in archs):
        return False
    if cfg.get("is_decoder"):
        return False
    return cfg.get("model_type") in {"bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "electra"} or any(
        a.endswith("Model") or "MaskedLM" in a for a in archs
    )
