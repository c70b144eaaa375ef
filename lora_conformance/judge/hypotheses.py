"""Named hypotheses about how an engine serves an adapter: the correct one and the bugs it might have.

A hypothesis is a transform of the reference's PEFT model: it rescales LoRA layers' ``scaling``
(the only place PEFT applies alpha, r, rsLoRA and patterns), so "down_proj LoRA dropped",
"delta x1.1", "rsLoRA ignored" or "patterns ignored" are computed by the reference itself,
exactly, on the same contexts as the correct hypothesis. Two more kinds need no transform:
``served_as`` (another adapter's reference: a routing bug) and ``base`` (no adapter at all).
MoE expert LoRA has a third: ``expert_routing`` re-weights, per token and selected expert, what
the fused experts' LoRA adds (an expert's down_proj LoRA output weighted otherwise than its base
output, or LoRA on only the first selected expert), from calls of PEFT's own experts module.

The suites ask the engine's effect (adapter minus base, from the engine) to be nearest the
correct hypothesis by a margin, and name the nearest one when it is not
(``lora_conformance.judge.effects``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from lora_conformance.checkpoints import module_rank_alpha, peft_scaling, scaling_rule

CORRECT = "correct"
BASE = "base"


@dataclass(frozen=True)
class Hypothesis:
    """``kind``: ``scale`` (every LoRA layer's scaling x ``factor``), ``drop`` (layers whose name
    ends with ``module`` contribute nothing), ``alpha_not_over_r`` / ``rslora_ignored`` /
    ``patterns_ignored`` (scaling recomputed the wrong way), ``served_as`` (another adapter,
    ``adapter`` names it), ``base`` (no adapter), ``expert_routing`` (``module`` names one of
    ``EXPERT_ROUTING``)."""

    name: str
    description: str
    kind: str
    factor: float = 1.0
    module: str = ""
    adapter: str = ""

    def key(self) -> dict[str, Any]:
        return {"kind": self.kind, "factor": self.factor, "module": self.module, "adapter": self.adapter}

    @property
    def needs_model(self) -> bool:
        return self.kind not in (BASE,)


def correct() -> Hypothesis:
    return Hypothesis(CORRECT, "served as PEFT serves it", "scale", 1.0)


def base() -> Hypothesis:
    return Hypothesis(BASE, "adapter ignored (base model)", BASE)


def served_as(other: str) -> Hypothesis:
    return Hypothesis(f"served as {other}", f"the request got adapter {other!r} instead", "served_as", adapter=other)


# Expert-level errors of a fused MoE LoRA path (kind ``expert_routing``): name -> description.
EXPERT_ROUTING: dict[str, str] = {
    "unweighted": "each expert's down_proj LoRA output added with weight 1, not its routing weight",
    "next_expert": "each expert's down_proj LoRA output weighted with the next selected expert's routing weight",
    "first_only": "expert LoRA applied only to each token's first (highest-weight) selected expert",
}


def expert_routing(mode: str) -> Hypothesis:
    return Hypothesis(f"expert LoRA {mode.replace('_', ' ')}", EXPERT_ROUTING[mode], "expert_routing", module=mode)


def _config(adapter_dir: Path) -> dict:
    from lora_conformance.checkpoints import read_adapter_config

    return read_adapter_config(adapter_dir)


def _targets(cfg: dict) -> list[str]:
    mods = cfg.get("target_modules") or []
    if isinstance(mods, str):
        mods = [mods]
    params = cfg.get("target_parameters") or []
    return sorted(set(mods)) + sorted(p.split(".", 1)[-1] if p.startswith("mlp.") else p for p in params)


def standard(adapter_dir: Path, others: Sequence[str] = ()) -> list[Hypothesis]:
    """The alternatives every adapter test separates from the correct hypothesis: delta x0.9 / x1.1,
    each targeted module (or expert parameter) dropped, alpha not divided by r, rsLoRA ignored
    (rsLoRA adapters), patterns ignored (adapters with patterns), another adapter of the same test
    (``others``) and no adapter at all."""
    cfg = _config(adapter_dir)
    out = [Hypothesis("delta x0.9", "the LoRA delta scaled by 0.9", "scale", 0.9),
           Hypothesis("delta x1.1", "the LoRA delta scaled by 1.1", "scale", 1.1)]
    targets = _targets(cfg)
    if len(targets) > 1:
        out += [Hypothesis(f"{t} LoRA dropped", f"the {t} LoRA is silently ignored", "drop", module=t) for t in targets]
    r = module_rank_alpha(cfg)[0]
    ranks = {r, *(cfg.get("rank_pattern") or {}).values()}
    if ranks != {1}:  # at rank 1, alpha and alpha / r are the same scaling
        out.append(Hypothesis("alpha not over r", "scaling lora_alpha instead of lora_alpha / r", "alpha_not_over_r"))
    if cfg.get("use_rslora"):
        out.append(Hypothesis("rsLoRA ignored", "scaling alpha / r instead of alpha / sqrt(r)", "rslora_ignored"))
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        out.append(Hypothesis("patterns ignored", "rank_pattern / alpha_pattern ignored in the scaling",
                              "patterns_ignored"))
    if any(t.endswith("down_proj") for t in cfg.get("target_parameters") or []):
        out += [expert_routing(m) for m in EXPERT_ROUTING]
    out += [served_as(o) for o in others]
    out.append(base())
    return out


# ---- applying a hypothesis to a PEFT model ---------------------------------------------------

def _lora_layers(model) -> list[tuple[str, Any]]:
    from peft.tuners.lora.layer import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def _layer_name(name: str, layer) -> str:
    # A ParamWrapper (target_parameters) names the parameter it wraps; nested wrappers of one
    # module (gate_up_proj inside down_proj) carry ``base_layer`` in their path.
    param = getattr(layer, "parameter_name", None)
    stem = name.replace(".base_layer", "")
    return f"{stem}.{param}" if param else stem


def _wrong_scaling(hyp: Hypothesis, layer, adapter: str, cfg: dict) -> float:
    """The scaling under ``hyp``: PEFT's rule (``checkpoints``) with one of its parts left out."""
    r, alpha = layer.r[adapter], layer.lora_alpha[adapter]
    if hyp.kind == "alpha_not_over_r":
        return alpha
    if hyp.kind == "rslora_ignored":
        return scaling_rule(r, alpha, use_rslora=False)
    if hyp.kind == "patterns_ignored":
        return peft_scaling(cfg)  # the adapter-wide r and lora_alpha (PEFT's defaults where unset)
    raise ValueError(f"hypothesis kind {hyp.kind!r} does not recompute the scaling")


class applied:
    """Context manager: the PEFT model under ``hyp`` (scalings restored on exit)."""

    def __init__(self, model, hyp: Hypothesis, adapter_dir: Optional[Path], adapter: str = "default"):
        self.model, self.hyp, self.adapter = model, hyp, adapter
        self.cfg = _config(adapter_dir) if adapter_dir is not None else {}
        self._saved: list[tuple[Any, float]] = []
        self._patched: list[Any] = []

    def __enter__(self):
        hyp = self.hyp
        if hyp.kind in ("served_as", BASE) or (hyp.kind == "scale" and hyp.factor == 1.0):
            return self.model
        if hyp.kind == "expert_routing":
            self._patch_experts(hyp.module)
            return self.model
        layers = _lora_layers(self.model)
        matched = 0
        for name, layer in layers:
            if self.adapter not in layer.scaling:
                continue
            old = layer.scaling[self.adapter]
            if hyp.kind == "scale":
                new = old * hyp.factor
            elif hyp.kind == "drop":
                if not (_layer_name(name, layer).endswith("." + hyp.module) or _layer_name(name, layer) == hyp.module):
                    continue
                new = 0.0
            else:
                new = _wrong_scaling(hyp, layer, self.adapter, self.cfg)
            self._saved.append((layer, old))
            layer.scaling[self.adapter] = new
            matched += 1
        if not matched:
            raise ValueError(f"hypothesis {hyp.name!r}: no LoRA layer of the reference model matches it "
                             f"(layers: {sorted({_layer_name(n, l).rsplit('.', 1)[-1] for n, l in layers})})")
        return self.model

    def _patch_experts(self, mode: str) -> None:
        """Replace each outermost PEFT experts wrapper's forward ``f(x, idx, w)`` (linear in the
        routing weights ``w``) by the hypothesis', from calls of the original with other weights and
        with LoRA scalings zeroed: the down_proj LoRA output is exactly full minus down-off, since
        down_proj is the experts' last linear map."""
        import torch

        wrappers = [m for n, m in _lora_layers(self.model)
                    if getattr(m, "parameter_name", None) == "down_proj" and ".base_layer" not in n]
        if not wrappers:
            raise ValueError(f"hypothesis {self.hyp.name!r}: the reference model has no LoRA on fused expert "
                             "down_proj parameters")
        adapter = self.adapter

        def layers_of(outer):
            out, m = [], outer
            while hasattr(m, "scaling") and adapter in getattr(m, "scaling", {}):
                out.append(m)
                m = m.base_layer
            return out

        def zeroed(layers, fn):
            saved = [(l, l.scaling[adapter]) for l in layers]
            try:
                for l, _ in saved:
                    l.scaling[adapter] = 0.0
                return fn()
            finally:
                for l, v in saved:
                    l.scaling[adapter] = v

        for outer in wrappers:
            original = outer.forward
            layers = layers_of(outer)
            down = [l for l in layers if l.parameter_name == "down_proj"]

            def forward(x, idx, w, *args, _orig=original, _layers=layers, _down=down, **kwargs):
                if mode == "first_only":
                    first = torch.zeros_like(w)
                    first[:, 0] = 1
                    return (_orig(x, idx, w * first, *args, **kwargs) +
                            zeroed(_layers, lambda: _orig(x, idx, w * (1 - first), *args, **kwargs)))
                target = torch.ones_like(w) if mode == "unweighted" else torch.roll(w, -1, dims=1)
                extra = target - w
                return (_orig(x, idx, w, *args, **kwargs) + _orig(x, idx, extra, *args, **kwargs) -
                        zeroed(_down, lambda: _orig(x, idx, extra, *args, **kwargs)))

            outer.forward = forward
            self._patched.append(outer)

    def __exit__(self, *exc):
        for layer, old in reversed(self._saved):
            layer.scaling[self.adapter] = old
        self._saved.clear()
        for m in self._patched:
            del m.forward  # the class's forward again
        self._patched.clear()
