"""Benign variations of the built-in engine: correct implementations that round differently.

``--engine-arg variant=NAME`` selects one. Each computes the same function as the default
engine (in exact arithmetic), so a conformance verdict must pass it in every dtype: these are
the negative controls a test's false-alarm rate is measured on (faults.py holds the positive
controls). In float32 each stays within 1e-4 logprob of the default engine
(tests/test_builtin_variants.py); ``bench/negative_controls.py`` prints how far each moves in
bfloat16 and float16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

VARIANTS: dict[str, str] = {
    "rescale:C": "adapter factors stored as (C*A, B/C), C a positive number: the same delta, other rounding",
    "svd": "lora_A and lora_B rebuilt from an SVD of B @ A (B = U sqrt(S), A = sqrt(S) V^T, per expert): the same "
           "delta from other factors, as an engine that re-factors or compresses adapters at load",
    "preround": "lora_A and lora_B rounded to the model dtype before the scaling is folded into B "
                "(the default's result where the scaling is a power of two)",
    "reverse": "the requests of a generate call admitted, and prefill rows ordered, in reverse",
    "one_at_a_time": "each request served alone (one batch per request)",
    "fp32_delta": "the LoRA delta (shrink and expand) computed in float32, added in the model dtype",
}

# Engine-arg dicts of correct engines that bench/power.py runs as negative controls on any device
# ("engine" names another engine; the rest are the built-in engine's args).
NEGATIVE_CONTROLS: list[dict[str, str]] = [
    {},  # the default built-in engine
    {"engine": "peft"},
    {"variant": "rescale:3"},
    {"variant": "rescale:0.3"},  # (a power of two would only move exponents: bit-identical)
    {"variant": "preround"},
    {"variant": "svd"},
    {"variant": "reverse"},
    {"variant": "one_at_a_time"},
    {"variant": "fp32_delta"},
]

# Built-in engine args that are negative controls only where the device has the feature.
DEVICE_CONTROLS: dict[str, list[dict[str, str]]] = {
    "graphs": [{"graphs": "0"}, {"graphs": "1"}],
    "triton": [{"kernels": "torch"}, {"kernels": "triton"}],
}


def negative_controls(device: str) -> list[dict[str, str]]:
    """NEGATIVE_CONTROLS plus the DEVICE_CONTROLS whose feature ``device`` has."""
    from lora_conformance import devices
    from lora_conformance.engines.builtin.layers import kernels

    out = list(NEGATIVE_CONTROLS)
    dev = devices.resolve_device(device)
    if devices.graphs_supported(dev):
        out += DEVICE_CONTROLS["graphs"]
    if devices.triton_backend(dev) and kernels.triton_status(dev) is None:
        out += DEVICE_CONTROLS["triton"]
    return out


@dataclass(frozen=True)
class Variant:
    """The selected variation (``name`` None: the default engine); ``factor`` is rescale's C."""

    name: Optional[str] = None
    factor: float = 1.0

    @classmethod
    def parse(cls, value: Optional[str]) -> "Variant":
        if value in (None, "", "none"):
            return cls()
        name, sep, param = str(value).partition(":")
        if name == "rescale":
            try:
                c = float(param)
            except ValueError:
                c = math.nan
            if not sep or not math.isfinite(c) or c <= 0:
                raise ValueError(f"engine arg variant={value!r}: rescale needs a positive finite factor, "
                                 f"as in variant=rescale:3 (got {param!r})")
            return cls("rescale", c)
        if sep or name not in VARIANTS:
            listing = "\n".join(f"  {k}: {v}" for k, v in VARIANTS.items())
            raise ValueError(f"engine arg variant={value!r}: unknown variant; the variants:\n{listing}")
        return cls(name)

    def on(self, name: str) -> bool:
        assert name in VARIANTS or name == "rescale", name  # a typo here would make a variant inert
        return self.name == name

    def __str__(self) -> str:
        return "default" if self.name is None else f"rescale:{self.factor:g}" if self.name == "rescale" else self.name
