"""Hand-set weights for the synthetic decoders (see synthetic.py for the why and the numbers).

The vocabulary is a 32 x 32 grid: token id = 32 * class + member. The residual stream
holds orthogonal code blocks (a randomised Hadamard basis, exact in bf16/fp16):

    d        1 dim   a constant "bias" direction present in every embedding
    X[c]    32 dims  the current token's class          Y[m]  32 dims  its member
    Z[c]    32 dims  class vote from the previous token W[m]  32 dims  member vote
    rest   127 dims  per-token random filler (keeps layers 1..n from being trivial)

Layer 0 has previous-token heads: q and k read only ``d`` (constant after RMSNorm, since
every embedding has the same norm), and RoPE makes the score peak one position back.
Their values carry the previous token's class / member one-hot, o_proj turns them into
votes. lm_head adds "successor of the current token" (X, Y) and the votes (Z, W) per
grid axis, so logits factor as class score + member score, each a sum of a few discrete
terms whose distinct totals are >= ``margin_unit`` apart.
"""

from __future__ import annotations

import math

import torch

GRID = 32  # classes x members; vocab = GRID * GRID


def hadamard_basis(n: int, g: torch.Generator) -> torch.Tensor:
    """An orthonormal basis with entries +-1/sqrt(n): exact in every float format. A width that is
    no power of two (the real shapes: 1536, 3584) is a block diagonal of Hadamard bases of its
    power-of-two parts, its rows permuted, so each code direction spreads over a part's coordinates."""
    if n & (n - 1):
        parts, left = [], n
        while left:
            p = 1 << (left.bit_length() - 1)
            parts.append(p)
            left -= p
        basis = torch.block_diag(*(hadamard_basis(p, g) for p in parts))
        return basis[torch.randperm(n, generator=g)][:, torch.randperm(n, generator=g)]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
    perm = torch.randperm(n, generator=g)
    return (h * signs)[:, perm] / math.sqrt(n)  # columns are basis vectors


def single_cycle(n: int, g: torch.Generator, offset: int = 0) -> torch.Tensor:
    """A permutation of offset..offset+n-1 that is one n-cycle (no short loops)."""
    order = torch.randperm(n, generator=g) + offset
    nxt = torch.empty(n + offset, dtype=torch.long)
    nxt[:offset] = torch.arange(offset)
    for i in range(n):
        nxt[order[i]] = order[(i + 1) % n]
    return nxt


def previous_token_rotary(head_dim: int, theta: float, pairs: int, score: float):
    """Constant q and k (length head_dim) whose RoPE score peaks at relative distance 1.

    For rotary pair i with frequency w_i, the score is sum_i r cos((m - n - 1) w_i);
    using the ``pairs`` fastest pairs makes distance 1 the unique maximum over 512
    positions. ``score`` is the peak q.k / sqrt(head_dim).
    """
    half = head_dim // 2
    w = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    k = torch.zeros(head_dim, dtype=torch.float64)
    q = torch.zeros(head_dim, dtype=torch.float64)
    r = score * math.sqrt(head_dim) / pairs
    for i in range(pairs):
        k[i] = 1.0
        # HF rotate_half pairs dim i with i + half; q = k rotated by -w_i.
        q[i], q[i + half] = r * math.cos(w[i]), -r * math.sin(w[i])
    return q, k
