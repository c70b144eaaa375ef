"""Rotary position embedding with a precomputed cos/sin table (default, linear, llama3 scaling)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lora_conformance.engines.base import UnsupportedFeatureError
from lora_conformance.engines.builtin.layers import into


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict], exponent_dim: int = 0) -> torch.Tensor:
    """``exponent_dim``: the dimension in theta's exponent (0: head_dim; fault rotary_assumes_head_dim_64)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / (exponent_dim or head_dim)))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        # Frequencies below the low-frequency band are divided by the factor, those above the
        # high-frequency band are kept, and the band in between is interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    raise UnsupportedFeatureError(f"rope scaling type {kind!r} (config.json) is not supported by the builtin engine")


def host_cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``angles`` (float32), computed in float64 by numpy on the host and returned in
    float32 on the angles' device: the tables are made once, so their cost does not matter, and each
    entry is the float64 value rounded once.

    Not torch's own cos: on cpu the torch 2.13 wheel computes float32 cos through MKL's vector math
    (vmsCos, asked for high accuracy), and in about one pytest process in twenty on this project's
    2-core cpu the first large cos of the process came back, for the half of the table the calling
    thread computed, bit-identical to MKL's *enhanced-performance* mode (errors up to 1.5e-4 where
    high accuracy errs by 4e-8). The engine's float32 logprobs then drifted by up to 8e-3 from the
    reference for the whole process (docs/method.md, "A platform fault in the rotary table")."""
    import numpy as np

    a = angles.detach().to("cpu", torch.float64).numpy()
    return (torch.from_numpy(np.cos(a)).to(angles.device, torch.float32),
            torch.from_numpy(np.sin(a)).to(angles.device, torch.float32))


class RotaryEmbedding(nn.Module):
    """cos/sin tables; ``lookup`` once per forward, ``apply`` per layer (three kernels for q and k)."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_len: int, device, dtype,
                 exponent_dim: int = 0):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling, exponent_dim).to(device)
        pos = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)  # exact products, as HF's (d,1)@(1,L) matmul
        cos, sin = host_cos_sin(freqs)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        half = head_dim // 2
        sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated): exact,
        # and swapping halves is one flip instead of neg + cat.
        self.register_buffer("sin_signed", (sin * sign).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for these positions, (T, 1, D): shared by every layer of the forward."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """out = x * cos + rotate_half(x) * sin for x (T, heads, D); out may be x itself."""
        cos, sin_signed = rope
        T, n, D = x.shape
        swapped = x.reshape(T, n, 2, D // 2).flip(2).view(T, n, D)
        return into(out, torch.addcmul, x * cos, swapped, sin_signed)
