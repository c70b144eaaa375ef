"""What OpenVINO CPU's dynamic quantisation does to activations, shown bit-exact.

The CPU plugin quantises the activations of a FullyConnected with compressed (u8 / u4) weights when
DYNAMIC_QUANTIZATION_GROUP_SIZE is set (its default) and the source is float32. This script feeds a
known matrix through a u8-compressed identity, so the output *is* the dequantised activations, and
compares it with candidate quantisers: symmetric groups of 32 / 64 / ... / the row with a float32 scale
max|x|/127, and asymmetric (min-max, u8 with a zero point). The one that matches exactly is what the
engine plugin declares (``OpenVINOEngine.declared_activations``: ``ov_dq32``), and it is the built-in
engine's ``activations=int8_alt`` quantiser of Q8_0 blocks, one of the implementations the tolerance
rows for 8-bit activations were calibrated on (judge/tolerances.py ACTIVATIONS).

    .venv-openvino/bin/python bench/openvino_dynamic_quant.py      # OpenVINO 2026.4.1 on this host: sym32 0.0
"""

from __future__ import annotations

import sys

import numpy as np


def dequantised_activations(x: np.ndarray, props: dict) -> np.ndarray:
    import openvino as ov
    from openvino import opset13 as ops

    k = x.shape[1]
    inp = ops.parameter([-1, k], ov.Type.f32, name="x")
    codes = ops.constant(np.eye(k, dtype=np.uint8) + 1, ov.Type.u8)  # (q - zp) * 1 = the identity
    zp = ops.constant(np.ones((k, 1), dtype=np.uint8), ov.Type.u8)
    w = ops.multiply(ops.subtract(ops.convert(codes, ov.Type.f16), ops.convert(zp, ov.Type.f16)),
                     ops.constant(np.ones((k, 1), np.float16)))
    model = ov.Model([ops.matmul(inp, ops.convert(w, ov.Type.f32), False, True)], [inp])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", **props})
    return compiled(x)[0], compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")


def symmetric(x: np.ndarray, group: int) -> np.ndarray:
    b = x.reshape(-1, group)
    d = np.abs(b).max(1, keepdims=True) / 127
    return (np.round(b / d) * d).reshape(x.shape)


def asymmetric(x: np.ndarray, group: int) -> np.ndarray:
    b = x.reshape(-1, group)
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    s = (hi - lo) / 255
    zp = np.round(-lo / s)
    return ((np.clip(np.round(b / s) + zp, 0, 255) - zp) * s).reshape(x.shape)


def main() -> int:
    k = 256
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, k)) * np.linspace(0.1, 3, k)).astype(np.float32)
    x[1] += 2.0  # a row with an offset, where an asymmetric scheme would differ most
    off, _ = dequantised_activations(x, {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    y, group = dequantised_activations(x, {})
    print(f"plugin default DYNAMIC_QUANTIZATION_GROUP_SIZE={group}; with it 0 the identity is exact: "
          f"max |y - x| {np.abs(off - x).max():.1e}; with the default {np.abs(y - x).max():.3e}")
    for name, emu in [(f"symmetric, groups of {g}", symmetric(x, g)) for g in (32, 64, 128, 256)] + \
                     [(f"asymmetric, groups of {g}", asymmetric(x, g)) for g in (32, 256)]:
        d = float(np.abs(y - emu).max())
        print(f"  {name:26s} max |plugin - emulation| {d:.3e}")
    import torch

    from lora_conformance.engines.builtin.layers.gguf_base import quantize_dequantize

    ours = quantize_dequantize(torch.from_numpy(x), "q8_0", other=True).numpy()
    d = float(np.abs(y - ours).max())
    print(f"  the built-in engine's int8_alt Q8_0 blocks: max |plugin - ours| {d:.3e}")
    return 0 if d == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
