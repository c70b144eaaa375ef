"""A guard on the reference's rotary tables: a wrong cos never reaches a reference output (or its cache).

On cpu, torch computes float32 cos through MKL's vector math, and once in about twenty pytest processes
on this project's cpu the first large cos of the process came back at MKL's enhanced-performance
accuracy (errors up to 1.5e-4) for the calling thread's half of the table (docs/method.md, "A platform
fault in the rotary table"). The built-in engine makes its tables in float64 since; the reference is
HF's model, whose rotary module computes cos and sin on every forward. This guard checks each of
those outputs: cos^2 + sin^2 must equal the module's ``attention_scaling``^2 within a few ulps of the
output dtype. A table that misses is computed again (the fault seen was transient) and the reference
counts it; a table wrong twice stops the reference with ``PlatformFaultError``.
"""

from __future__ import annotations

from typing import Any

ULPS = 16  # allowed |cos^2 + sin^2 - s^2| in eps of the output dtype: float32 1.9e-6 (the fault: 3e-4)


class PlatformFaultError(RuntimeError):
    """The platform computed the reference's rotary table wrong twice in a row."""


def table_error(cos, sin, scaling: float = 1.0) -> float:
    """max |cos^2 + sin^2 - scaling^2| over the tables, computed in float64."""
    c, s = cos.double(), sin.double()
    return float((c * c + s * s - scaling * scaling).abs().max()) if c.numel() else 0.0


def rotary_modules(model: Any) -> list:
    """The rotary-embedding modules of an HF model (transformers names them ``*RotaryEmbedding``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _bound(output_dtype, scaling: float) -> float:
    import torch

    return ULPS * torch.finfo(output_dtype).eps * max(1.0, scaling * scaling)


class RotaryGuard:
    """Forward hooks on every ``*RotaryEmbedding`` module of a model (``install``); ``recomputed``
    counts the tables computed again."""

    def __init__(self) -> None:
        self.recomputed = 0

    def install(self, model: Any) -> None:
        """Hook every rotary module of ``model``. Deep copies of the model (PEFT's adapted copies) keep
        the hooks."""
        for module in rotary_modules(model):
            module.register_forward_hook(self._check, with_kwargs=True)

    def _check(self, module, args, kwargs, output):
        if not (isinstance(output, tuple) and len(output) == 2 and all(hasattr(t, "dtype") for t in output)):
            return None  # not a (cos, sin) pair of tensors: nothing this guard knows how to check
        scaling = float(getattr(module, "attention_scaling", 1.0) or 1.0)
        cos, sin = output
        bound = _bound(cos.dtype, scaling)
        first = table_error(cos, sin, scaling)
        if first <= bound:
            return None
        again = module.forward(*args, **kwargs)
        second = table_error(again[0], again[1], scaling)
        if second <= bound:
            self.recomputed += 1
            return again
        raise PlatformFaultError(
            f"the reference's rotary table ({type(module).__name__}) is wrong twice in a row: "
            f"|cos^2 + sin^2 - {scaling:g}^2| reached {first:.3g}, then {second:.3g} (bound {bound:.2g}): torch's "
            f"cos / sin on this platform does not give float accuracy (docs/method.md, \"A platform fault in "
            f"the rotary table\"); no reference output was made from it")
