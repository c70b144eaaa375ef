"""What a base-model checkpoint or a PEFT adapter directory says, read in one place.

Every module that needs a checkpoint's kind, an adapter's config, the name of a LoRA tensor or a
dtype name asks this module, so the harness, the reference and the engines cannot disagree on
them (they did: a RoBERTa checkpoint was a decoder for the harness and an encoder for the engines).

* ``model_kind``: ``"decoder"``, ``"moe"`` or ``"encoder"``, by one rule (below).
* ``read_adapter_config``: ``adapter_config.json`` as a dict, or ``AdapterFormatError`` naming the
  file and what is wrong; ``adapter_info``: the fields that decide whether an engine can serve it.
* ``split_lora_key``, ``pattern_value``: PEFT's tensor names and rank/alpha pattern matching.
* ``module_rank_alpha``, ``scaling_rule``, ``peft_scaling``: PEFT's LoRA scaling (its defaults,
  patterns and rsLoRA), the one copy every engine plugin, converter and hypothesis uses.
* ``DTYPE_NAMES``, ``torch_dtype``: the dtype names the project accepts.

Stdlib only at import time (torch is imported inside ``torch_dtype``): the plugin, the option
table and the engine plugins that run without torch import it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

from lora_conformance.errors import AdapterFormatError

PathLike = Union[str, Path]

# ---- dtypes ---------------------------------------------------------------------------------

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """The torch dtype for one of ``DTYPE_NAMES``; ValueError listing them otherwise."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


# ---- base-model checkpoints -----------------------------------------------------------------

MODEL_KINDS = ("decoder", "moe", "encoder")
# model_type values that are encoders whatever their architectures list says.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "electra"})


def read_model_config(model_dir: PathLike) -> dict:
    """``config.json`` of a checkpoint directory (OSError / ValueError as json and open raise them)."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def kind_of_config(cfg: Mapping[str, Any]) -> str:
    """The one rule, in order: an architecture with a causal-LM head, or ``is_decoder``, makes a
    decoder; otherwise an encoder ``model_type`` (BERT, RoBERTa, ...) or a head-less / masked-LM
    architecture (``BertModel``, ``RobertaForMaskedLM``) makes an encoder; anything else is a
    decoder. A decoder with experts (``num_local_experts``, ``num_experts``) is ``moe``."""
    archs = [str(a) for a in cfg.get("architectures") or ()]
    causal = any("CausalLM" in a for a in archs) or bool(cfg.get("is_decoder"))
    if not causal and (cfg.get("model_type") in ENCODER_MODEL_TYPES
                       or any(a.endswith("Model") or "MaskedLM" in a for a in archs)):
        return "encoder"
    return "moe" if cfg.get("num_local_experts") or cfg.get("num_experts") else "decoder"


def model_kind(model_dir: PathLike) -> str:
    """``"decoder"``, ``"moe"`` or ``"encoder"``, from the checkpoint's ``config.json``."""
    return kind_of_config(read_model_config(model_dir))


def is_encoder(model_dir: PathLike) -> bool:
    """True for an encoder checkpoint (loaded with ``AutoModel``, served by ``embed``); False also
    where ``config.json`` is unreadable (the loader that follows says what is wrong with it)."""
    try:
        return model_kind(model_dir) == "encoder"
    except (OSError, ValueError):
        return False


# ---- PEFT adapter directories ---------------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."
# Tensor-name suffix -> (factor, embedding?): linear LoRA is lora_A/B.weight, embedding LoRA is a
# bare parameter lora_embedding_A/B.
LORA_TENSOR_SUFFIXES = {".lora_A.weight": ("A", False), ".lora_B.weight": ("B", False),
                        ".lora_embedding_A": ("A", True), ".lora_embedding_B": ("B", True)}


@dataclass(frozen=True)
class LoraKey:
    """A LoRA tensor's name taken apart: the module it adapts (PEFT's prefix and ``base_layer``
    wrappers removed), which factor, whether it is an embedding's, and the ``base_layer`` nesting
    depth (two LoRAs on one module's fused parameters nest)."""

    module: str
    factor: str  # "A" | "B" | "" (not a LoRA factor: a DoRA magnitude, a bias, a full copy)
    embedding: bool = False
    depth: int = 0


def split_lora_key(key: str) -> LoraKey:
    """'base_model.model.X.base_layer.lora_A.weight' -> LoraKey('X', 'A', False, 1)."""
    k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    for suffix, (factor, embedding) in LORA_TENSOR_SUFFIXES.items():
        if k.endswith(suffix):
            mod, depth = k[: -len(suffix)], 0
            while mod.endswith(".base_layer"):
                mod, depth = mod[: -len(".base_layer")], depth + 1
            return LoraKey(mod, factor, embedding, depth)
    return LoraKey(k, "")


def pattern_value(patterns: Mapping[str, Any], module: str, default, matcher=None):
    """PEFT semantics of ``rank_pattern`` / ``alpha_pattern``: a key matches a dot-bounded suffix
    of the module name; the first match wins. Matched in bounded time (``patterns.PatternMatcher``:
    a key that backtracks catastrophically is refused, not left to hang a load)."""
    from lora_conformance.patterns import PatternMatcher

    return (matcher or PatternMatcher()).value_for(patterns, module, default)


# PEFT's LoraConfig defaults (peft/tuners/lora/config.py): a config without ``r`` or ``lora_alpha``
# gets these, so a missing ``lora_alpha`` is 8 whatever the rank.
PEFT_DEFAULT_R = 8
PEFT_DEFAULT_ALPHA = 8


def module_rank_alpha(cfg: Mapping[str, Any], module: str | None = None, matcher=None) -> tuple[int, float]:
    """PEFT's ``(r, lora_alpha)`` for ``module``: the first ``rank_pattern`` / ``alpha_pattern`` key
    that matches it (``pattern_value``), else ``r`` / ``lora_alpha``, else PEFT's defaults (8, 8).
    ``module=None``: the adapter-wide values, patterns not applied."""
    r = cfg.get("r", PEFT_DEFAULT_R)
    alpha = cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if module is not None:
        r = pattern_value(cfg.get("rank_pattern") or {}, module, r, matcher)
        alpha = pattern_value(cfg.get("alpha_pattern") or {}, module, alpha, matcher)
    return int(r), float(alpha)


def scaling_rule(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's rule (``LoraLayer.update_layer``): ``alpha / sqrt(rank)`` with rsLoRA, else ``alpha / rank``."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def peft_scaling(cfg: Mapping[str, Any], module: str | None = None, matcher=None) -> float:
    """The scaling PEFT gives ``module``'s LoRA (``LoraLayer.scaling``) under adapter config ``cfg``;
    ``module=None``: the adapter-wide one (patterns not applied)."""
    return scaling_rule(*module_rank_alpha(cfg, module, matcher), bool(cfg.get("use_rslora", False)))


def read_adapter_config(path: PathLike) -> dict:
    """``<path>/adapter_config.json`` as a dict; ``AdapterFormatError(file, field, problem)`` where
    the directory or file is missing, not UTF-8, not JSON or not an object."""
    path = Path(path)
    f = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise AdapterFormatError(path, "directory", "is not a directory")
    if not f.is_file():
        raise AdapterFormatError(f, "file", f"not found (a PEFT adapter directory has {ADAPTER_CONFIG})")
    try:
        cfg = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AdapterFormatError(f, "encoding", f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise AdapterFormatError(f, "file", f"unreadable ({exc})") from None
    except ValueError as exc:
        raise AdapterFormatError(f, "json", f"not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterFormatError(f, "json", f"expected an object, got {type(cfg).__name__}")
    return cfg


def target_modules(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """``target_modules`` as a tuple (PEFT also takes one string: a regex, or ``all-linear``)."""
    tm = cfg.get("target_modules") or ()
    return (tm,) if isinstance(tm, str) else tuple(tm)


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


def adapter_info(path: PathLike) -> AdapterInfo:
    """``read_adapter_config`` summarised; ``AdapterFormatError`` for a config that is not LoRA."""
    path = Path(path)
    cfg = read_adapter_config(path)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterFormatError(path / ADAPTER_CONFIG, "peft_type", f"{cfg.get('peft_type')!r} is not LORA")
    r = module_rank_alpha(cfg)[0]
    pattern = cfg.get("rank_pattern") or {}
    return AdapterInfo(
        path=path,
        rank=r,
        max_rank=max([r, *(int(v) for v in pattern.values())]),
        use_dora=bool(cfg.get("use_dora")),
        use_rslora=bool(cfg.get("use_rslora")),
        modules_to_save=tuple(cfg.get("modules_to_save") or ()),
        bias=str(cfg.get("bias") or "none"),
        lora_bias=bool(cfg.get("lora_bias")),
        target_modules=target_modules(cfg),
        target_parameters=tuple(cfg.get("target_parameters") or ()),
        has_rank_pattern=bool(pattern or cfg.get("alpha_pattern")),
        raw=cfg,
    )
