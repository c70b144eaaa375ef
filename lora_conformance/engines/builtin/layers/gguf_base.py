"""The built-in engine's GGUF bases (``--base-quant q8_0`` / ``q4_k``, models/quant.py's schemes), and
8-bit activations in front of their quantised matmuls (``--engine-arg activations=int8``).

The engine reads each quantised tensor's GGUF blocks (the checkpoint's ``quantized/base.safetensors``,
what the llama.cpp converter writes as they are) and decodes them once at load to the compute dtype
(models/quant.py's dequantiser, bit-exact with gguf-py's): its matmuls then run on those weights, as a
GPU engine that dequantises GGUF blocks for a float GEMM does. The float file's copy of those tensors
is replaced, not read.

llama.cpp's CPU kernels never multiply float activations by Q8_0 or Q4_K weights: each activation
row is first quantised to the weight type's ``vec_dot_type`` (``ggml-cpu``'s type traits), Q8_0 in
front of Q8_0 weights (blocks of 32, one float16 scale ``d = max|x| / 127``, ``q = round(x / d)``
half away from zero) and Q8_K in front of Q4_K weights (blocks of 256, ``iscale = -127 / x_m`` with
``x_m`` the block's value of largest magnitude, ``q = nearest_int(iscale * x)`` clamped to 127, a
float32 ``d = 1 / iscale``). Their LoRA matmuls read the activations as they are. The built-in
engine with ``activations=int8`` on a ``q8_0`` or ``q4_k`` base does the same: each group whose
weights the checkpoint quantised multiplies its base weight (the snapped float weights, which the
GGUF blocks dequantise to exactly) by the quantised-then-dequantised activations, and adds its LoRA
delta computed from the float activations. It is a correct engine of that arithmetic, which is what
the tolerance row for 8-bit activations (judge/tolerances.py ``ACTIVATIONS``) is calibrated on,
together with other correct quantisers of the same blocks (``activations=int8_alt``)
and PEFT with the same quantisation in front of its base layers (``engines/peft_engine.py``).

The quantisers are pure functions of the activations (``quantize_dequantize``), shared by the
engines that emulate them.
"""

from __future__ import annotations

from typing import Callable

import torch

from lora_conformance.models.quant import GGUF_ACTIVATIONS as FOR_BASE

BLOCK: dict[str, int] = {"q8_0": 32, "q8_k": 256}  # activation scheme (models/quant.py ACTIVATION_SCHEMES) -> block


def _round_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_dequantize(x: torch.Tensor, scheme: str, other: bool = False) -> torch.Tensor:
    """``x`` (..., K) through the activation quantiser ``scheme`` and back, in ``x``'s dtype; the
    arithmetic in float32. ``other``: another correct quantiser of the same blocks, for the negative
    controls (``activations=int8_alt``): Q8_0 rounded half to even with its scale kept in float32; Q8_K
    with its scale rounded to float16 (ggml keeps it in float32)."""
    block = BLOCK[scheme]
    if x.shape[-1] % block:
        raise ValueError(f"activation quantiser {scheme}: rows of {x.shape[-1]} values are not whole blocks of {block}")
    b = x.float().reshape(-1, block)
    if scheme == "q8_0":  # ggml's quantize_row_q8_0: d = max|x| / 127 in float16, q rounded half away
        d = b.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.round(b * inv) if other else _round_away(b * inv)
        d = d if other else d.half().float()
    else:  # ggml's quantize_row_q8_K: the signed value of largest magnitude maps to -127, d in float32
        mx = torch.gather(b, 1, b.abs().argmax(dim=1, keepdim=True))
        iscale = torch.where(mx == 0, torch.zeros_like(mx), -127 / mx)
        q = torch.clamp(torch.round(iscale * b), max=127)
        d = torch.where(iscale == 0, torch.zeros_like(iscale), 1 / iscale)
        d = d.half().float() if other else d
    return (q * d).reshape(x.shape).to(x.dtype)


def quantizer(scheme: str, other: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: quantize_dequantize(x, scheme, other)


class ActQuantBase:
    """A group's float base weight read through quantised activations; the LoRA delta reads ``x``."""

    def __init__(self, weights: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor],
                 skip_lora: bool = False):
        self.wt = torch.cat(weights).t().contiguous()  # (in, N)
        self.fn = fn
        self.skip_lora = skip_lora  # the fault quant_lora_skipped: quantised groups apply no LoRA

    def forward(self, group, x: torch.Tensor) -> torch.Tensor:
        from lora_conformance.engines.builtin.layers.linear import _mm

        y = _mm(self.fn(x), self.wt, None)
        if group.b_all is not None:
            y.add_(group.b_all[: group.N])
        batch = None if self.skip_lora else group._batch()
        if batch is not None:
            group.paths()[batch.path][1](y, x, batch)
        return y


def attach(model: torch.nn.Module, model_dir, rules) -> int:
    """For a GGUF base (q8_0, q4_k): every LoRA linear group whose weights the checkpoint quantised
    gets them decoded from its GGUF blocks, and where ``rules.activations`` (layers/int8_linear.py
    QuantRules) is not float an ``ActQuantBase`` with the activation quantiser llama.cpp's CPU kernels
    use for that scheme (int8_alt: the other one; before ``fuse_linear_groups``); returns how many
    groups (0 for any other checkpoint). ``rules.skip_lora``: the fault quant_lora_skipped (those
    groups apply no LoRA; with 8-bit activations only)."""
    from lora_conformance.engines.builtin.layers.int8_linear import stored_groups
    from lora_conformance.models import quant

    base_scheme = quant.scheme_of(model_dir)
    if base_scheme not in FOR_BASE:
        return 0
    stored = quant.load_quantized(model_dir)
    fn = quantizer(FOR_BASE[base_scheme], rules.activations == "int8_alt")
    done = 0
    for g, keys in stored_groups(model, stored, model_dir, "GGUF blocks"):
        for k, p in zip(keys, g.parts):
            w = quant.dequantize(base_scheme, stored[k], (p.out_features, p.in_features))
            p.weight.data = torch.from_numpy(w).to(device=p.weight.device, dtype=p.weight.dtype)
        done += 1
        if rules.activations == "float":
            continue
        g.quant = ActQuantBase([p.weight.data for p in g.parts], fn, rules.skip_lora)
        off = 0
        for p in g.parts:  # the parts' weights become views of the group's (in, N) copy: no second copy
            p.weight.data = g.quant.wt[:, off: off + p.out_features].t()
            off += p.out_features
    return done

