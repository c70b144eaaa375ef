"""The built-in engine's int8 weight-only base (``--base-quant int8``, models/quant.py's scheme).

A quantised ``LinearGroup`` holds its parts' int8 codes (N, in) and one float32 scale per output
channel, and no float copy of the weight: each forward dequantises in the matmul,
``y = (x @ q^T) * scale + bias``, with q cast to the compute dtype (int8 values are exact in
bfloat16, float16 and float32). The LoRA stays float and is added after the scale, as a float
base's delta is: ``y += (x @ A^T) @ B * scaling`` through the group's own delta paths
(layers/linear.py), which never read the base weight.

The parts' ``weight`` parameters become zero-stride views of one zero (their shape is what
adapter loading reads): whatever read them as the base would read zeros, not a stale float copy.
Tensor parallelism is refused (the shards are not cut from int8 codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class QuantRules:
    """How a quantised group applies its scale and its LoRA (defaults: correct; each other value
    only under a fault of engines/builtin/faults.py, decided in engine/plan.py)."""

    delta_before_scale: bool = False  # the LoRA delta added to x @ q^T, then scaled with the base
    skip_lora: bool = False  # quantised groups apply no LoRA
    one_scale: bool = False  # every output channel dequantised with channel 0's scale
    # What a GGUF base's (q8_0, q4_k) quantised groups read: engine arg activations (layers/gguf_base.py)
    activations: str = "float"


class Int8Base:
    """A group's int8 codes and per-channel scales (the parts' rows, in order)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, rules: QuantRules):
        self.qt = q.t().contiguous()  # (in, N) int8: x @ qt reads contiguous rows
        self.scale = scale.float()
        if rules.one_scale:
            self.scale = self.scale[:1].expand_as(self.scale).contiguous()
        self.rules = rules
        self._cast: dict = {}  # compute dtype -> scale in it

    def scale_in(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.scale.to(dtype)
        return self._cast[dtype]

    def forward(self, group, x: torch.Tensor) -> torch.Tensor:
        """The group's output for 2-D ``x``: base through the int8 codes, bias, LoRA delta."""
        from lora_conformance.engines.builtin.layers.linear import _mm

        acc = _mm(x, self.qt.to(x.dtype), None)  # x @ q^T, not yet scaled
        batch = None if self.rules.skip_lora else group._batch()
        delta = None if batch is None else group.paths()[batch.path][1]
        if delta is not None and self.rules.delta_before_scale:
            delta(acc, x, batch)  # the fault: the delta scaled with the base
            delta = None
        y = acc.mul_(self.scale_in(x.dtype))
        if group.b_all is not None:
            y.add_(group.b_all[: group.N])
        if delta is not None:
            delta(y, x, batch)
        return y


def stored_groups(model: torch.nn.Module, stored, model_dir, what: str):
    """(group, its parts' checkpoint keys) for every LoRA linear group whose parts ``stored`` holds a
    quantised form of; a group with only some of its parts there is an error (``what`` names the form)."""
    from lora_conformance.engines.builtin.layers.linear import LoraLinear

    names = {id(m): n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, LoraLinear)}
    for g in groups.values():
        keys = [names[id(p)] + ".weight" for p in g.parts]
        found = [k in stored for k in keys]
        if not any(found):
            continue
        if not all(found):
            raise ValueError(f"{model_dir}: {what} for only some of {keys} (a fused group is all or none)")
        yield g, keys


def attach(model: torch.nn.Module, model_dir: Path, rules: QuantRules, dtype: torch.dtype, tp=None) -> int:
    """Give every LoRA linear group whose parts the checkpoint stores as int8 its ``Int8Base``
    (before ``fuse_linear_groups``); returns how many groups. A checkpoint of another scheme is
    the engine's refusal (``Engine.check_base_quant``), never reached here."""
    from lora_conformance.engines.base import UnsupportedFeatureError
    from lora_conformance.models.quant import load_quantized, scheme_of

    if scheme_of(model_dir) != "int8":
        return 0
    if tp is not None and getattr(tp, "size", 1) > 1:
        raise UnsupportedFeatureError("engine 'builtin': an int8 base with tensor_parallel_size > 1 "
                                      "(shards are not cut from int8 codes)")
    stored = load_quantized(model_dir)
    done = 0
    for g, keys in stored_groups(model, stored, model_dir, "int8 codes"):
        device = g.parts[0].weight.device
        q = torch.cat([torch.from_numpy(stored[k]["qweight"]) for k in keys]).to(device)
        s = torch.cat([torch.from_numpy(stored[k]["scale"]) for k in keys]).to(device)
        if tuple(q.shape) != (g.N, g.in_features):
            raise ValueError(f"{model_dir}: int8 codes of {keys} have shape {tuple(q.shape)}, "
                             f"expected {(g.N, g.in_features)}")
        g.quant = Int8Base(q, s, rules)
        for p in g.parts:
            p.weight.data = torch.zeros((), dtype=dtype, device=device).expand(p.out_features, p.in_features)
        done += 1
    return done
