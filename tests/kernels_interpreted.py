"""The fused decode kernels (layers/kernels.py) compute what the eager torch ops compute.

Run by tests/test_builtin_kernels.py in a fresh process with TRITON_INTERPRET=1: Triton's cpu
interpreter needs the variable before triton's first import (which peft does on import). The interpreter rounds
float32 -> bfloat16 toward zero where the GPU backends round to nearest even, so bfloat16 results
are checked to two bfloat16 steps of the eager result; float32 ones to float32 rounding. On a GPU
the same comparisons run through bench/gpu_validation.sh (kernels part).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # never collected by the main run (not test_*.py)
    raise RuntimeError("run through tests/test_builtin_kernels.py (needs TRITON_INTERPRET=1 from the start)")
import triton  # noqa: E402,F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lora_conformance.engines.base import UnsupportedFeatureError  # noqa: E402
from lora_conformance.engines.builtin import BuiltinEngine  # noqa: E402
from lora_conformance.engines.builtin.layers import kernels  # noqa: E402
from lora_conformance.engines.builtin.layers.lora import LoraBatch  # noqa: E402
from lora_conformance.engines.builtin.layers.rotary import RotaryEmbedding  # noqa: E402

from test_builtin_engine import check_against_reference, llama  # noqa: E402,F401  (fixture)
from test_builtin_fast_paths import _accelerator_layout  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    else:  # two bfloat16 steps of the result or of the operands' scale (sums that cancel): truncated
        # intermediate roundings; a wrong slot, half or sign is off by the operands' size
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=2**-7 * scale)


def gen(seed: int):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_norm_then_weight(dtype):
    g = gen(0)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(96, generator=g)).to(dtype)
    close(kernels.ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), None, 1e-6) * w)
    wide = torch.randn(5, 200, generator=g).to(dtype)  # rows of a wider buffer, width not a power of 2
    close(kernels.ops.rms_norm(wide[:, :96], w, 1e-5), F.rms_norm(wide[:, :96], (96,), None, 1e-5) * w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_rope_equals_eager_rotary_on_strided_heads(dtype, in_place):
    """q and k heads as views of the fused qkv output (row stride > heads * D); v untouched."""
    g = gen(1)
    T, H, KVH, D = 5, 6, 2, 24  # D/2 = 12: not a power of 2
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    rot = RotaryEmbedding(D, 10000.0, None, 64, "cpu", dtype)
    rope = rot.lookup(torch.tensor([0, 3, 17, 40, 63]))
    qk = qkv[:, : (H + KVH) * D].view(T, -1, D)
    ref = RotaryEmbedding.apply(qk, rope, out=torch.empty_like(qk))
    got_qkv = qkv.clone()
    src = got_qkv[:, : (H + KVH) * D].view(T, -1, D)
    out = src if in_place else torch.full_like(qk, float("nan"))
    kernels.ops.rope_(src, rope[0], rope[1], out)
    close(out, ref)
    assert torch.equal(got_qkv[:, (H + KVH) * D:], qkv[:, (H + KVH) * D:])  # v
    if not in_place:
        assert torch.equal(got_qkv, qkv)  # the source is only read


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_into_a_buffer_view(dtype):
    g = gen(2)
    inter = 40
    gu = (torch.randn(3, 2 * inter, generator=g) * 4).to(dtype)
    buf = torch.full((3, inter + 9), 7.0, dtype=dtype)
    kernels.ops.silu_mul(gu, inter, buf[:, :inter])
    close(buf[:, :inter], F.silu(gu[:, :inter]) * gu[:, inter:])
    assert torch.all(buf[:, inter:] == 7)  # the rest of the buffer is not written


def _group_pool(P: int, S: int, R: int, cols: list[int], dtype, g):
    """Block-diagonal Bt (P*S*R, N), as LinearGroup.alloc_pool lays it out."""
    N = sum(cols)
    Bt = torch.zeros(P * S * R, N, dtype=dtype)
    off = 0
    for p in range(P):
        Bt[p * S * R:(p + 1) * S * R, off:off + cols[p]] = (torch.randn(S * R, cols[p], generator=g) * 0.3).to(dtype)
        off += cols[p]
    return Bt


SLOTS = torch.tensor([0, -1, 2, 1, 3, 2, -1])  # -1 base; 3 == S: out of range (adapter_index_off_by_one)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [[24], [24, 16], [20, 8, 8]], ids=["1part", "2parts", "3parts"])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_lora_expand_equals_the_masked_gemm(dtype, cols, alpha):
    """y += alpha * (h * mask) @ Bt, reading only each row's own slot; base and out-of-range rows
    unchanged; the shrink columns are not written."""
    g = gen(3)
    S, R, P = 3, 4, len(cols)
    N = sum(cols)
    out = torch.randn(len(SLOTS), N + P * S * R, generator=g).to(dtype)  # [base | shrink], as the fused GEMM
    Bt = _group_pool(P, S, R, cols, dtype, g)
    mask = LoraBatch.build(SLOTS, S, dtype).mask(R, P)
    ref = out.clone()
    ref[:, :N].addmm_(out[:, N:] * mask, Bt, alpha=alpha)
    got = out.clone()
    starts = [sum(cols[:k]) for k in range(1, P)] + [N, N]
    kernels.ops.lora_expand_(got[:, :N], got[:, N:], Bt, SLOTS, S, R, starts[0], starts[1], alpha)
    close(got[:, :N], ref[:, :N])
    base_rows = (SLOTS < 0) | (SLOTS >= S)
    assert torch.equal(got[base_rows, :N], out[base_rows, :N])
    assert torch.equal(got[:, N:], out[:, N:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [20, 300])
def test_lora_shrink_writes_own_slot_and_zeros(dtype, K):
    """out = alpha * mask * (x @ A^T) into the buffer columns after x (the cat layout)."""
    g = gen(4)
    S, R = 3, 4
    buf = torch.randn(len(SLOTS), K + S * R, generator=g).to(dtype)
    A = (torch.randn(S * R, K, generator=g) * 0.2).to(dtype)
    mask = LoraBatch.build(SLOTS, S, dtype).mask(R, 1)
    for alpha in (1.0, 2.0):
        got = buf.clone()
        kernels.ops.lora_shrink(got[:, :K], A, SLOTS, got[:, K:], S, R, alpha)
        close(got[:, K:], torch.mm(buf[:, :K], A.t()) * mask * alpha)
        assert torch.equal(got[:, :K], buf[:, :K])
        assert torch.all(got[(SLOTS < 0) | (SLOTS >= S), K:] == 0)


def test_kernels_reject_rows_they_cannot_index():
    x = torch.randn(4, 8).t()  # column-major
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.ops.rms_norm(x, torch.ones(4), 1e-6)


def test_selection(monkeypatch):
    assert kernels.select("cpu", "torch") is False
    assert kernels.select("cpu", "auto") is False  # the interpreter is for tests, never chosen by itself
    assert kernels.select("cpu", "triton") is True  # TRITON_INTERPRET=1 (set above)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UnsupportedFeatureError, match="kernels=triton: triton has no backend for device 'cpu'"):
        kernels.select("cpu", "triton")


def test_engine_arg_is_validated(llama):  # noqa: F811
    base, _ = llama
    with pytest.raises(ValueError, match="engine arg kernels='fast': expected one of auto, torch, triton"):
        BuiltinEngine(base, "cpu", "float32", {"kernels": "fast"})


def test_engine_on_the_kernels_matches_peft(llama, monkeypatch):  # noqa: F811
    """The whole decode path on the accelerator layout with every fused kernel, against PEFT
    (float32: the interpreter's bfloat16 truncation is not what a GPU computes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict = {}

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("lora_conformance."):
                seen[name] = seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    base, ads = llama
    with BuiltinEngine(base, "cpu", "float32", {"kernels": "triton"}) as eng:
        assert eng.fused_kernels and "kernels: triton" in eng.version()
        _accelerator_layout(eng)
        for n, p in ads.items():
            eng.load_adapter(n, p)
        with Spy():
            check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", None], "float32", max_new=3)
    for op in ("rms_norm", "rope_", "silu_mul", "lora_expand_", "lora_shrink"):
        assert seen.get(f"lora_conformance.{op}.default", 0) > 0, (op, seen)
