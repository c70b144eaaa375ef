"""Quantised bases: each scheme's quantise and dequantise, and the snapped checkpoint.

``--base-quant SCHEME`` serves the base quantised and the LoRA in float, as users serve it. The
reference must judge the LoRA effect on the same base the engine holds, so the synthesized base
is *snapped* first: every quantised tensor goes through quantise -> dequantise. The snapped
checkpoint directory (``snapped_checkpoint``) holds

* ``model.safetensors``: the dequantised weights in float32 (what HF + PEFT, the reference, loads),
* ``quantized/base.safetensors``: the quantised form of each tensor (what the engine loads: the
  llama.cpp converter writes its blocks as they are, the built-in engine its int8 and scales, the
  OpenVINO converter its u8/u4 constants, zero points and scales),
* ``quantization.json``: the scheme, the tensors quantised, and how the reference was made.

Dequantising the stored form gives exactly the snapped weights (``tests/test_quant.py`` checks it
for every scheme, and gguf's own ``dequantize`` agrees with ours for the GGUF types), so the engine
receives exactly what the reference's weights round-trip to.

Schemes (all weight-only, on the decoder layers' linear weights ``*_proj.weight``; embeddings,
lm_head, norms and biases stay float, as llama.cpp's and NNCF's defaults keep them near float):

=========  ===================================================================================
int8       per output channel, symmetric: scale = max|w| / 127 (float32), q = round(w / scale)
           in [-127, 127]; w' = q * scale. The built-in engine's int8 linear.
q8_0       GGUF Q8_0: blocks of 32 along the input, d = max|w| / 127 stored as float16,
           q = roundf(w / d) (ggml's rounding: half away from zero); w' = q * fp16(d).
q4_k       GGUF Q4_K: super-blocks of 256 (8 sub-blocks of 32), w' = d * sc_j * q - dmin * m_j,
           q in 0..15, sc_j / m_j 6-bit, d / dmin float16. Our quantiser (gguf-py has none) takes
           each sub-block's min (at most 0) and range; llama.cpp searches further, a format
           needs no particular search: any valid blocks are served as they are.
ov_int8    NNCF's INT8_ASYM layout: per output channel, u8 with a u8 zero point, scale
           (max - min) / 255 (the range widened to hold 0) stored as float16, rounded up so
           nothing clips; w' = (q - zp) * fp16(scale). Our quantiser, not NNCF's.
ov_int4    NNCF's INT4_ASYM layout: groups of 128 along the input, u4 with a u4 zero point,
           float16 scale (max - min) / 15 per group; w' = (q - zp) * fp16(scale).
=========  ===================================================================================

No torch import at module level: the option's choices are read from ``SCHEMES`` by the plugin.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import numpy as np

# scheme -> what it is, for the report and the option's help
SCHEMES: dict[str, str] = {
    "none": "float base (no quantisation)",
    "int8": "int8 weight-only, per output channel, symmetric (float32 scale)",
    "q8_0": "GGUF Q8_0 (blocks of 32, float16 scale)",
    "q4_k": "GGUF Q4_K (super-blocks of 256, 6-bit sub-block scales and mins, float16 d / dmin)",
    "ov_int8": "OpenVINO / NNCF INT8_ASYM (per output channel, u8 zero point, float16 scale)",
    "ov_int4": "OpenVINO / NNCF INT4_ASYM (groups of 128, u4 zero point, float16 scale)",
}
# Activation schemes: where an engine's kernels quantise the activations in front of a quantised base's
# matmuls (Engine.declared_activations), what they quantise to. llama.cpp's CPU kernels read each
# activation row as the weight type's vec_dot_type: Q8_0 in front of Q8_0 weights, Q8_K in front of Q4_K.
ACTIVATION_SCHEMES: dict[str, str] = {
    "q8_0": "8-bit activation blocks of 32 with a float16 scale (ggml's Q8_0, in front of Q8_0 weights)",
    "q8_k": "8-bit activation blocks of 256 with a float32 scale (ggml's Q8_K, in front of Q4_K weights)",
    "ov_dq32": "8-bit activation groups of 32 with a float32 scale max|x|/127 (OpenVINO CPU's dynamic quantisation "
               "in front of compressed weights, DYNAMIC_QUANTIZATION_GROUP_SIZE=32)",
}
GGUF_ACTIVATIONS: dict[str, str] = {"q8_0": "q8_0", "q4_k": "q8_k"}  # base scheme -> its activation scheme


def quantised_scheme(model_dir: Union[str, Path, None]) -> str:
    """The scheme of a checkpoint whose manifest quantised at least one tensor; 'none' for a float
    checkpoint or one whose manifest quantised nothing (an encoder's: --base-quant snaps decoders)."""
    m = None if model_dir is None else read_manifest(model_dir)
    return m["scheme"] if m is not None and m["tensors"] else "none"


def gguf_activations(model_dir: Union[str, Path, None]) -> "str | None":
    """The activation scheme llama.cpp's CPU kernels read in front of this checkpoint's GGUF-quantised
    tensors (None: not a GGUF base, or one that quantised no tensor)."""
    return GGUF_ACTIVATIONS.get(quantised_scheme(model_dir))

# Bump when a quantiser changes: it is part of the snapped checkpoint's key and of reference keys.
QUANT_VERSION = 1
QUANTIZED_FILE = "quantized/base.safetensors"
MANIFEST = "quantization.json"
Q8_0_BLOCK, QK_K, INT4_GROUP = 32, 256, 128
Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2  # d, dmin, packed scales/mins, nibbles


class QuantError(ValueError):
    """A tensor that a scheme cannot hold (its input size not a multiple of the block)."""


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown base quantisation {scheme!r}; expected one of {', '.join(SCHEMES)}")
    return scheme


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Which checkpoint tensors a scheme quantises: the decoder layers' 2-D linear weights."""
    return (len(shape) == 2 and name.startswith("model.layers.") and name.endswith("_proj.weight"))


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf: half away from zero (ggml's rounding; numpy's round is half to even)."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def _blocks(w: np.ndarray, size: int, what: str) -> np.ndarray:
    if w.shape[-1] % size:
        raise QuantError(f"{what}: input size {w.shape[-1]} is not a multiple of {size}")
    return w.reshape(-1, size)


# ---- int8 (the built-in engine's) ------------------------------------------------------------

def quantize_int8(w: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(w, dtype=np.float32)
    scale = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return {"qweight": q, "scale": scale}


def dequantize_int8(t: dict[str, np.ndarray]) -> np.ndarray:
    return t["qweight"].astype(np.float32) * t["scale"].astype(np.float32)[:, None]


# ---- GGUF Q8_0 -------------------------------------------------------------------------------

def quantize_q8_0(w: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of Q8_0 blocks (34 bytes per 32 weights), bit-exact with ggml's ``quantize_row_q8_0_ref``."""
    w = np.asarray(w, dtype=np.float32)
    b = _blocks(w, Q8_0_BLOCK, "q8_0")
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = _roundf(b * inv).astype(np.int8)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    return {"blocks": blocks.reshape(w.shape[0], -1)}


def dequantize_q8_0(t: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    b = t["blocks"].reshape(-1, 2 + Q8_0_BLOCK)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    q = b[:, 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(shape)


# ---- GGUF Q4_K -------------------------------------------------------------------------------

def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes, the layout ggml's ``get_scale_min_k4`` reads."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _unpack_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def quantize_q4_k(w: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of Q4_K super-blocks (144 bytes per 256 weights), written from the GGUF block layout:
    per sub-block j of 32, its range over 15 levels (rounded up to a 6-bit multiple of the
    super-block's float16 ``d``, so its top never clips) and its min (at most 0, stored as a
    positive 6-bit multiple m_j of ``dmin``, subtracted). The nibbles are computed from the
    *stored* scales: each weight is off by at most half its sub-block's step plus half ``dmin``."""
    w = np.asarray(w, dtype=np.float32)
    b = _blocks(w, QK_K, "q4_k").reshape(-1, 8, 32)
    lo = np.minimum(b.min(axis=2), 0).astype(np.float32)  # (n, 8)
    rng = (b.max(axis=2) - lo).astype(np.float32)
    scale_j = rng / np.float32(15)
    d = (scale_j.max(axis=1) / np.float32(63)).astype(np.float16)  # (n,)
    dmin = ((-lo).max(axis=1) / np.float32(63)).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.ceil(scale_j / d32[:, None]), 0)  # up: the top never clips
        mn = np.where(dmin32[:, None] > 0, np.rint(-lo / dmin32[:, None]), 0)
    sc, mn = np.clip(sc, 0, 63).astype(np.uint8), np.clip(mn, 0, 63).astype(np.uint8)
    step = d32[:, None] * sc.astype(np.float32)  # (n, 8)
    off = dmin32[:, None] * mn.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[:, :, None] > 0, np.rint((b + off[:, :, None]) / step[:, :, None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # (n, 8, 32)
    # nibbles: byte c*32 + i holds sub-block 2c (low) and 2c + 1 (high), element i
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, QK_K // 2)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), _pack_scales(sc, mn), qs],
                            axis=1)
    return {"blocks": blocks.reshape(w.shape[0], -1)}


def dequantize_q4_k(t: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    b = t["blocks"].reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _unpack_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32).astype(np.float32)
    step = (d * sc.astype(np.float32))[:, :, None]
    off = (dmin * mn.astype(np.float32))[:, :, None]
    return (step * q - off).reshape(shape)


# ---- OpenVINO / NNCF asymmetric ----------------------------------------------------------------

def _quantize_asym(w: np.ndarray, levels: int) -> dict[str, np.ndarray]:
    """Rows of ``w`` (each a channel or a group): u-levels with a zero point, float16 scale. The
    zero point and codes come from the *stored* float16 scale."""
    lo = np.minimum(w.min(axis=1, keepdims=True), 0)
    hi = np.maximum(w.max(axis=1, keepdims=True), 0)
    exact = (hi - lo) / np.float32(levels)
    scale = exact.astype(np.float16)
    scale = np.where(scale.astype(np.float32) < exact, np.nextafter(scale, np.float16(np.inf)), scale)  # up: no clip
    s = scale.astype(np.float32)
    safe = np.where(s == 0, np.float32(1), s)
    zp = np.clip(np.rint(-lo / safe), 0, levels).astype(np.uint8)
    q = np.clip(np.rint(w / safe) + zp, 0, levels).astype(np.uint8)
    return {"qweight": q, "zero_point": zp, "scale": scale}


def _dequantize_asym(t: dict[str, np.ndarray]) -> np.ndarray:
    # (q - zp) has at most 9 bits and a float16 scale 11: the product is exact in float32.
    return (t["qweight"].astype(np.float32) - t["zero_point"].astype(np.float32)) * t["scale"].astype(np.float32)


def quantize_ov_int8(w: np.ndarray) -> dict[str, np.ndarray]:
    return _quantize_asym(np.asarray(w, dtype=np.float32), 255)


def dequantize_ov_int8(t: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    return _dequantize_asym(t).reshape(shape)


def quantize_ov_int4(w: np.ndarray) -> dict[str, np.ndarray]:
    """Groups of 128 along the input: qweight (out, in) u8 holding 0..15, zero_point and scale
    (out, in / 128)."""
    w = np.asarray(w, dtype=np.float32)
    out, n = w.shape
    t = _quantize_asym(_blocks(w, INT4_GROUP, "ov_int4"), 15)
    return {"qweight": t["qweight"].reshape(out, n), "zero_point": t["zero_point"].reshape(out, -1),
            "scale": t["scale"].reshape(out, -1)}


def dequantize_ov_int4(t: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    out, n = shape
    g = {"qweight": t["qweight"].reshape(-1, INT4_GROUP), "zero_point": t["zero_point"].reshape(-1, 1),
         "scale": t["scale"].reshape(-1, 1)}
    return _dequantize_asym(g).reshape(shape)


@dataclass(frozen=True)
class Scheme:
    name: str
    quantize: Callable[[np.ndarray], dict[str, np.ndarray]]
    dequantize: Callable[[dict[str, np.ndarray], tuple[int, int]], np.ndarray]


_SCHEMES = {
    "int8": Scheme("int8", quantize_int8, lambda t, shape: dequantize_int8(t).reshape(shape)),
    "q8_0": Scheme("q8_0", quantize_q8_0, dequantize_q8_0),
    "q4_k": Scheme("q4_k", quantize_q4_k, dequantize_q4_k),
    "ov_int8": Scheme("ov_int8", quantize_ov_int8, dequantize_ov_int8),
    "ov_int4": Scheme("ov_int4", quantize_ov_int4, dequantize_ov_int4),
}


def scheme(name: str) -> Scheme:
    check_scheme(name)
    if name == "none":
        raise ValueError("scheme 'none' has no quantiser")
    return _SCHEMES[name]


def quantize(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    return scheme(name).quantize(np.asarray(w, dtype=np.float32))


def dequantize(name: str, t: dict[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    return scheme(name).dequantize(t, tuple(shape))


def snap(name: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the quantised form, its dequantised float32 weights)."""
    t = quantize(name, w)
    return t, dequantize(name, t, np.asarray(w).shape)


# ---- the snapped checkpoint ---------------------------------------------------------------------

def read_manifest(model_dir: Union[str, Path]) -> dict | None:
    """The checkpoint's ``quantization.json`` (None: a float checkpoint)."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        check_scheme(manifest["scheme"])
        if not isinstance(manifest["tensors"], dict):
            raise TypeError("tensors is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a quantisation manifest ({type(exc).__name__}: {exc}); "
                         "expected {scheme, tensors: {name: shape}, reference}") from None
    return manifest


def scheme_of(model_dir: Union[str, Path]) -> str:
    """The checkpoint's base quantisation ('none' for a float checkpoint)."""
    m = read_manifest(model_dir)
    return "none" if m is None else m["scheme"]


def load_quantized(model_dir: Union[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    """The quantised form of each quantised tensor: name -> {field: array}."""
    from safetensors.numpy import load_file

    path = Path(model_dir) / QUANTIZED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the quantised base is missing (its {MANIFEST} names a scheme)")
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in load_file(str(path)).items():
        name, _, field = key.rpartition(":")
        out.setdefault(name, {})[field] = value
    return out


REFERENCE_NOTE = ("HF transformers + PEFT on the dequantised base: each quantised tensor snapped through "
                  "quantise -> dequantise (lora_conformance.models.quant) before the reference and the engine "
                  "see it; the engine is given the quantised form, which dequantises to exactly those weights")


def snapped_checkpoint(model_dir: Union[str, Path], name: str, cache_dir: Union[str, Path]) -> Path:
    """``model_dir`` (a float HF checkpoint) with its quantisable tensors snapped by scheme ``name``,
    built once into ``cache_dir`` (keyed by the float checkpoint's content, the scheme and
    ``QUANT_VERSION``). ``name == 'none'`` returns ``model_dir`` itself."""
    check_scheme(name)
    model_dir = Path(model_dir)
    if name == "none":
        return model_dir
    if read_manifest(model_dir) is not None:
        raise ValueError(f"{model_dir} is already a quantised checkpoint ({MANIFEST})")
    from lora_conformance.fileio import build_directory_once
    from lora_conformance.models import content_hash

    key = hashlib.sha256(f"{content_hash(model_dir)}|{name}|{QUANT_VERSION}".encode()).hexdigest()[:16]
    final = Path(cache_dir) / f"{model_dir.name}-{name}-{key}"
    return build_directory_once(final, lambda d: (d / MANIFEST).is_file(),
                                lambda tmp: _write_snapped(model_dir, name, tmp))


def _write_snapped(model_dir: Path, name: str, out: Path) -> None:
    import shutil

    from safetensors.numpy import load_file, save_file

    from lora_conformance.models import content_hash

    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{model_dir}: no *.safetensors weights to quantise")
    for p in model_dir.iterdir():  # config, tokenizer, generation config, pooling: as they are
        if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith("."):
            shutil.copy(p, out / p.name)
    tensors: dict[str, np.ndarray] = {}
    for f in weights:
        tensors.update(load_file(str(f)))
    floats: dict[str, np.ndarray] = {}
    packed: dict[str, np.ndarray] = {}
    shapes: dict[str, list[int]] = {}
    for key in sorted(tensors):
        w = tensors[key]
        if quantizable(key, w.shape) and w.dtype.kind == "f":
            t, w = snap(name, w.astype(np.float32))
            shapes[key] = list(w.shape)
            for field, value in t.items():
                packed[f"{key}:{field}"] = np.ascontiguousarray(value)
        floats[key] = np.ascontiguousarray(w.astype(np.float32) if w.dtype.kind == "f" else w)
    if not shapes:
        raise ValueError(f"{model_dir}: scheme {name!r} found no tensor to quantise (decoder layers' *_proj.weight)")
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "quantized").mkdir()
    save_file(packed, str(out / QUANTIZED_FILE))
    manifest = {"scheme": name, "description": SCHEMES[name], "quant_version": QUANT_VERSION,
                "float_checkpoint": {"name": model_dir.name, "content_hash": content_hash(model_dir)},
                "tensors": shapes, "kept_float": sorted(k for k in floats if k not in shapes),
                "reference": REFERENCE_NOTE}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    content_hash(out)


def describe(model_dir: Union[str, Path]) -> dict | None:
    """What the report records about a quantised base (None for a float one)."""
    m = read_manifest(model_dir)
    if m is None:
        return None
    return {"scheme": m["scheme"], "description": m["description"], "quantized_tensors": len(m["tensors"]),
            "kept_float": len(m["kept_float"]), "float_checkpoint": m["float_checkpoint"],
            "reference": m["reference"]}
