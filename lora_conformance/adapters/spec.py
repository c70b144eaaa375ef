"""What an adapter is made of: target sets and the (hashable, serialisable) AdapterSpec."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

# Named PEFT target sets. "moe_experts" targets the fused 3-D expert parameters of the
# synthetic Mixtral (transformers 5 keeps experts as mlp.experts.gate_up_proj (E, 2I, H)
# and mlp.experts.down_proj (E, H, I)), which PEFT reaches through target_parameters.
TARGET_SETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "embed_tokens": ("embed_tokens",),
    "lm_head": ("lm_head",),
    "moe_experts": (),
    # BERT encoder
    "query": ("query",),
    "value": ("value",),
    "query_value": ("query", "value"),
    "encoder_attention": ("query", "key", "value", "attention.output.dense"),
}
MOE_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
BIAS_VALUES = ("none", "all", "lora_only")
MAX_RANK = 256


def _frozen(d: Optional[Mapping[str, Any]]) -> tuple:
    return tuple(sorted((d or {}).items()))


@dataclass(frozen=True)
class AdapterSpec:
    targets: Union[str, tuple[str, ...]] = "qv"
    rank: int = 8
    alpha: float = 16
    use_rslora: bool = False
    rank_pattern: tuple = field(default_factory=tuple)  # given as a dict, stored as sorted pairs
    alpha_pattern: tuple = field(default_factory=tuple)
    layers_to_transform: Optional[tuple[int, ...]] = None
    use_dora: bool = False
    modules_to_save: Optional[tuple[str, ...]] = None
    bias: str = "none"
    zero: bool = False  # B = 0: an adapter that must leave the base output unchanged
    seed: int = 0
    b_std: Optional[float] = None  # None: the calibrated default (synth.B_STD)
    target_parameters: Optional[tuple[str, ...]] = None
    # Per-module B std (module suffix -> std), over b_std: makes a weak module's effect (q_proj,
    # k_proj) large enough for a test to tell "that module dropped" from correct in bfloat16.
    b_std_pattern: tuple = field(default_factory=tuple)

    def __post_init__(self):
        # Accept dicts/lists from callers, keep hashable tuples inside.
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if isinstance(self.rank_pattern, Mapping):
            set_("rank_pattern", _frozen(self.rank_pattern))
        if isinstance(self.alpha_pattern, Mapping):
            set_("alpha_pattern", _frozen(self.alpha_pattern))
        if isinstance(self.b_std_pattern, Mapping):
            set_("b_std_pattern", _frozen(self.b_std_pattern))
        for k in ("layers_to_transform", "modules_to_save", "target_parameters"):
            v = getattr(self, k)
            if v is not None and not isinstance(v, tuple):
                set_(k, tuple(v))
        if isinstance(self.targets, list):
            set_("targets", tuple(self.targets))
        self.validate()

    def validate(self) -> None:
        if isinstance(self.targets, str) and self.targets not in TARGET_SETS:
            raise ValueError(f"targets: unknown set {self.targets!r}; expected one of {', '.join(TARGET_SETS)}")
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank: expected 1..{MAX_RANK}, got {self.rank}")
        bad = {k: v for k, v in self.rank_pattern if not 1 <= int(v) <= MAX_RANK}
        if bad:
            raise ValueError(f"rank_pattern: expected ranks 1..{MAX_RANK}, got {bad}")
        if self.bias not in BIAS_VALUES:
            raise ValueError(f"bias: expected one of {', '.join(BIAS_VALUES)}, got {self.bias!r}")
        if self.b_std is not None and not self.b_std >= 0:
            raise ValueError(f"b_std: expected a number >= 0, got {self.b_std!r}")
        if any(not float(v) >= 0 for _, v in self.b_std_pattern):
            raise ValueError(f"b_std_pattern: expected numbers >= 0, got {dict(self.b_std_pattern)!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rank_pattern"], d["alpha_pattern"] = dict(self.rank_pattern), dict(self.alpha_pattern)
        d["b_std_pattern"] = dict(self.b_std_pattern)
        if not d["b_std_pattern"]:
            del d["b_std_pattern"]  # specs without it keep their cache keys
        for k in ("targets", "layers_to_transform", "modules_to_save", "target_parameters"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AdapterSpec":
        return cls(**d)

    def cache_key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def resolve_targets(spec: AdapterSpec, base_dir: Optional[Path] = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(target_modules, target_parameters) for PEFT."""
    if isinstance(spec.targets, str):
        modules = TARGET_SETS[spec.targets]
        params = MOE_EXPERT_PARAMETERS if spec.targets == "moe_experts" else ()
    else:
        modules, params = tuple(spec.targets), ()
    if spec.target_parameters:
        params = tuple(spec.target_parameters)
    return modules, params
