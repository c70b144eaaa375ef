"""Fused decode kernels (Triton) for the built-in engine on accelerators.

Decode is bound by kernel launches, not by FLOPs: a decode step of the Qwen2-shaped benchmark
model ran ~30 kernels per layer, most of them elementwise ops of a few microseconds each. These
kernels fold each run of them into one launch, computing what the eager torch ops compute
(same float32 math, the same roundings to the model dtype in between, where eager rounds):

* ``rms_norm``: ``F.rms_norm(x) * weight`` (the HF order: round the normalised row, then weight)
* ``rope_``: ``x * cos + swap_halves(x) * sin_signed`` into ``out`` (three eager kernels)
* ``silu_mul``: ``silu(gate) * up`` into ``out`` (two)
* ``lora_expand_``: ``y += alpha * (h * own-slot mask) @ Bt`` with the mask made in registers from
  the rows' slots (no mask tensor, no separate multiply), one tensor-core dot per tile, and each
  column block reading only its own parts' rows of the block-diagonal pool
* ``lora_shrink``: ``out = alpha * mask * (x @ A^T)`` with only the row's own slot computed and
  the other slots' columns written as zeros: the masked shrink of the cat layout in one kernel

Each is a ``torch.ops.lora_conformance`` operator (written arguments declared in the schema), so
the stream race detector and op counters see them like any aten op. Sums run in a different
order than cuBLAS / torch's reductions: results agree to float32 rounding before the final
rounding, not always bitwise. Graph capture replays them like any other kernel.

``select(device, mode)`` decides: ``auto`` uses them where Triton has a backend for the device
(cuda, xpu), ``torch`` never, ``triton`` always (an error where Triton cannot run; on cpu only
under ``TRITON_INTERPRET=1``, which the tests use to run the kernels without a GPU).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Optional

import torch

from lora_conformance import devices
from lora_conformance.engines.base import UnsupportedFeatureError
from lora_conformance.engines.builtin.args import KERNEL_MODES as MODES  # declared with the engine args


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_status(device: str) -> Optional[str]:
    """None if the Triton kernels can run on this device, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"triton is not importable ({type(e).__name__}: {e})"
    if _interpret() or devices.triton_backend(device):
        return None
    return (f"triton has no backend for device {device!r} (cuda needs compute capability 8.0 or newer; "
            "TRITON_INTERPRET=1 runs its cpu interpreter, for tests)")


def select(device: str, mode: str) -> bool:
    """Whether the engine uses the fused kernels (engine arg ``kernels``)."""
    if mode == "torch" or (mode == "auto" and not devices.triton_backend(device)):
        return False  # (auto does not import triton where it has no backend)
    why = triton_status(device)
    if mode == "triton":
        if why is not None:
            raise UnsupportedFeatureError(f"engine arg kernels=triton: {why}")
        return True
    return why is None


@functools.lru_cache(maxsize=2)
def _jit(interpret: bool) -> SimpleNamespace:
    """The Triton kernels, jitted on first use (in interpreter mode if the tests asked for it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_k(x, w, out, sx, so, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        xv = tl.load(x + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / N + eps)
        normed = (xv * rstd).to(out.dtype.element_ty)  # rounded, as F.rms_norm returns it
        wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * so + cols, (normed.to(tl.float32) * wv).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def rope_k(src, out, cos, sin, s0, s1, o0, o1, n_heads, D, HALF,
               BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # Each element's store is made by the thread that loaded it (same layout for the two
        # halves), so out may be src itself.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        m = (h < n_heads) & (d < HALF)
        p = src + t * s0 + h * s1 + d
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        dm = d < HALF
        c1 = tl.load(cos + t * D + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t * D + HALF + d, mask=dm, other=0.0).to(tl.float32)
        n1 = tl.load(sin + t * D + d, mask=dm, other=0.0).to(tl.float32)
        n2 = tl.load(sin + t * D + HALF + d, mask=dm, other=0.0).to(tl.float32)
        ty = out.dtype.element_ty
        # eager: addcmul(x * cos, swapped, sin_signed): x * cos rounded, then one fused add
        y1 = (x1.to(tl.float32) * c1).to(ty).to(tl.float32) + x2.to(tl.float32) * n1
        y2 = (x2.to(tl.float32) * c2).to(ty).to(tl.float32) + x1.to(tl.float32) * n2
        q = out + t * o0 + h * o1 + d
        tl.store(q, y1.to(ty), mask=m)
        tl.store(q + HALF, y2.to(ty), mask=m)

    @triton.jit
    def silu_mul_k(gu, out, sg, so, inter, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu + t * sg + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + t * sg + inter + cols, mask=m, other=0.0).to(tl.float32)
        ty = out.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # silu, rounded as eager returns it
        tl.store(out + t * so + cols, (s * u).to(ty), mask=m)

    @triton.jit
    def lora_expand_k(y, h, bt, slots, sy, sh, sb, T, N, c1, c2, alpha,
                      S: tl.constexpr, R: tl.constexpr, P: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[rows, cols] += alpha * (h * own-slot mask) @ Bt, the mask made in registers from the
        # slots; Bt is block-diagonal, so a column block reads only its own parts' K rows.
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < T
        n0 = tl.program_id(1) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < N
        n1 = tl.minimum(n0 + BLOCK_N, N) - 1
        p_lo = (n0 >= c1).to(tl.int32) + (n0 >= c2).to(tl.int32)
        p_hi = (n1 >= c1).to(tl.int32) + (n1 >= c2).to(tl.int32)
        slot = tl.load(slots + m, mask=mm, other=-1)  # -1 and out-of-range slots match no column
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(P):
            if (p >= p_lo) & (p <= p_hi):
                for kc in tl.static_range(0, S * R, BLOCK_K):
                    k = p * S * R + kc + tl.arange(0, BLOCK_K)
                    km = k < (p + 1) * S * R
                    hv = tl.load(h + m[:, None].to(tl.int64) * sh + k[None, :], mask=mm[:, None] & km[None, :],
                                 other=0.0)
                    hv = tl.where(((k // R) % S)[None, :] == slot[:, None], hv, tl.zeros_like(hv))
                    bv = tl.load(bt + k[:, None].to(tl.int64) * sb + n[None, :], mask=km[:, None] & nm[None, :],
                                 other=0.0)
                    if IEEE:  # float32 (or the interpreter, whose dot reads bfloat16 as raw bits):
                        # exact float32 products, as the masked GEMM computes them, no tf32
                        acc = tl.dot(hv.to(tl.float32), bv.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(hv, bv, acc)
        ptr = y + m[:, None].to(tl.int64) * sy + n[None, :]
        msk = mm[:, None] & nm[None, :]
        yv = tl.load(ptr, mask=msk, other=0.0).to(tl.float32)
        tl.store(ptr, (yv + alpha * acc).to(y.dtype.element_ty), mask=msk)

    @triton.jit
    def lora_shrink_k(x, a, slots, out, sx, sa, so, S, R, alpha, K: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program per (row, rank index r): the dot of x's row with its own slot's A row r,
        # written at that slot's column r; the other slots' column r get zeros
        t = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1)
        slot = tl.load(slots + t)
        own = (slot >= 0) & (slot < S)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if own:
            arow = a + (slot * R + r).to(tl.int64) * sa
            for k0 in tl.static_range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                km = kk < K
                xv = tl.load(x + t * sx + kk, mask=km, other=0.0).to(tl.float32)
                av = tl.load(arow + kk, mask=km, other=0.0).to(tl.float32)
                acc += av * xv
        ty = out.dtype.element_ty
        v = tl.sum(acc, axis=0).to(ty).to(tl.float32) * alpha  # the shrink rounded as the GEMM returns it
        s = tl.arange(0, BLOCK_S)
        vals = tl.where(s == slot, v, 0.0)
        tl.store(out + t * so + s * R + r, vals.to(ty), mask=s < S)

    return SimpleNamespace(rms_norm=rms_norm_k, rope=rope_k, silu_mul=silu_mul_k, lora_expand=lora_expand_k,
                           lora_shrink=lora_shrink_k)


def _k() -> SimpleNamespace:
    return _jit(_interpret())


def _p2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _row_major(t: torch.Tensor, name: str) -> None:
    if not rows_ok(t):
        raise ValueError(f"{name}: expected a 2-d tensor with contiguous rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


# ---- the operators -------------------------------------------------------------------------
_lib = torch.library.Library("lora_conformance", "DEF")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("rope_(Tensor src, Tensor cos, Tensor sin, Tensor(a!) out) -> ()")
_lib.define("silu_mul(Tensor gu, int inter, Tensor(a!) out) -> ()")
_lib.define("lora_expand_(Tensor(a!) y, Tensor h, Tensor bt, Tensor slots, int S, int R, int c1, int c2, "
            "float alpha) -> ()")
_lib.define("lora_shrink(Tensor x, Tensor a, Tensor slots, Tensor(a!) out, int S, int R, float alpha) -> ()")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _row_major(x, "rms_norm x")
    T, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T:
        BLOCK = _p2(N)
        _k().rms_norm[(T,)](x, weight, out, x.stride(0), out.stride(0), N, eps, BLOCK=BLOCK,
                            num_warps=4 if BLOCK <= 2048 else 8)
    return out


def _rope(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    T, n, D = src.shape
    if src.stride(2) != 1 or out.stride(2) != 1 or D % 2:
        raise ValueError(f"rope_: head dim must be contiguous and even, got strides {src.stride()} / {out.stride()}")
    if T:
        _k().rope[(T,)](src, out, cos, sin, src.stride(0), src.stride(1), out.stride(0), out.stride(1), n, D,
                        D // 2, BLOCK_H=_p2(n), BLOCK_HALF=_p2(D // 2))


def _silu_mul(gu: torch.Tensor, inter: int, out: torch.Tensor) -> None:
    _row_major(gu, "silu_mul gu")
    _row_major(out, "silu_mul out")
    T = gu.shape[0]
    if T:
        BLOCK = min(_p2(inter), 1024)
        _k().silu_mul[(T, -(-inter // BLOCK))](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=BLOCK)


def _lora_expand(y, h, bt, slots, S: int, R: int, c1: int, c2: int, alpha: float) -> None:
    for t, name in ((y, "lora_expand_ y"), (h, "lora_expand_ h"), (bt, "lora_expand_ bt")):
        _row_major(t, name)
    T, N = y.shape
    P = 1 + (c1 < N) + (c2 < N)
    if h.shape[1] < P * S * R or bt.shape[0] < P * S * R:
        raise ValueError(f"lora_expand_: h {tuple(h.shape)} / bt {tuple(bt.shape)} hold fewer than "
                         f"{P} parts x {S} slots x rank {R}")
    if T:
        BLOCK_M, BLOCK_N = min(64, max(16, _p2(T))), 64
        BLOCK_K = min(64, max(16, _p2(S * R)))
        _k().lora_expand[(-(-T // BLOCK_M), -(-N // BLOCK_N))](
            y, h, bt, slots, y.stride(0), h.stride(0), bt.stride(0), T, N, c1, c2, alpha, S=S, R=R, P=P,
            IEEE=y.dtype == torch.float32 or _interpret(), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def _lora_shrink(x, a, slots, out, S: int, R: int, alpha: float) -> None:
    for t, name in ((x, "lora_shrink x"), (a, "lora_shrink a"), (out, "lora_shrink out")):
        _row_major(t, name)
    T, K = x.shape
    if T:
        BLOCK_K = max(16, min(_p2(K), 8192))  # one pass over K up to 8192: loads in parallel, no loop latency
        _k().lora_shrink[(T, R)](x, a, slots, out, x.stride(0), a.stride(0), out.stride(0), S, R, alpha, K=K,
                                 BLOCK_S=_p2(S), BLOCK_K=BLOCK_K, num_warps=4 if BLOCK_K <= 2048 else 8)


for _name, _fn in (("rms_norm", _rms_norm), ("rope_", _rope), ("silu_mul", _silu_mul),
                   ("lora_expand_", _lora_expand), ("lora_shrink", _lora_shrink)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")

ops = torch.ops.lora_conformance


def attach(model: torch.nn.Module, on: bool) -> None:
    """Switch the model's layers (and their linear groups) to the fused kernels, or back."""
    for m in model.modules():
        if hasattr(m, "use_kernels"):
            m.use_kernels = on
        group = getattr(m, "group", None)
        if group is not None and hasattr(group, "use_kernels"):
            group.use_kernels = on


def rows_ok(*tensors: torch.Tensor) -> bool:
    """2-d with contiguous rows: what the kernels index (callers fall back to torch ops otherwise)."""
    return all(t.dim() == 2 and t.stride(1) == 1 for t in tensors)
