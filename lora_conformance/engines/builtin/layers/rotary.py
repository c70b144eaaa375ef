"""Rotary position embedding with a precomputed cos/sin table (default, linear, llama3 scaling)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lora_conformance.engines.base import UnsupportedFeatureError


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_len: int, device, dtype):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling).to(device)
        pos = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)  # exact products, as HF's (d,1)@(1,L) matmul
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: (T, H, D), k: (T, KVH, D)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
