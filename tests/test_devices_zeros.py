"""devices.zeros: torch.zeros whose cpu pages are only paid for where they are written (the KV cache)."""

import math

import pytest
import torch

from lora_conformance import devices


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_shape_and_writes_match_torch_zeros(dtype):
    shape = (128, 16, 2, 2, 64)  # 1 MiB or more: the lazily mapped path
    z = devices.zeros(shape, dtype, "cpu")
    assert z.shape == shape and z.dtype == dtype and z.device.type == "cpu", (z.shape, z.dtype, z.device)
    assert math.prod(shape) * z.element_size() >= devices.LAZY_ZERO_MIN_BYTES
    assert torch.equal(z, torch.zeros(shape, dtype=dtype))
    z[3, 2, 1] = 1.5
    other = devices.zeros(shape, dtype, "cpu")
    assert float(z[3, 2, 1, 0, 0]) == 1.5 and float(z.sum()) == 1.5 * 2 * 64, float(z.sum())
    assert float(other.abs().sum()) == 0.0, "a second allocation must not share the first one's pages"


def test_small_tensors_are_plain_zeros():
    z = devices.zeros((4, 4), torch.float32, "cpu")
    assert torch.equal(z, torch.zeros(4, 4)) and z.is_contiguous()


def test_untouched_pages_cost_no_memory():
    nbytes = 256 * 1024**2
    before = resident_bytes()
    z = devices.zeros((nbytes // 4,), torch.float32, "cpu")
    grown = resident_bytes() - before
    assert grown < nbytes // 8, f"{grown / 1e6:.1f} MB resident after a {nbytes / 1e6:.0f} MB lazy zeros (expected < 1/8)"
    z[: 1024 * 1024] = 1.0  # 4 MB written: those pages, and only those, become resident
    assert resident_bytes() - before < nbytes // 8 + 8 * 1024**2
    del z


def test_builtin_engine_kv_cache_is_not_paid_up_front(llama):
    from lora_conformance.engines import create_engine

    before = resident_bytes()
    engine = create_engine("builtin", llama, "cpu", "float32", {})
    kv = sum(t.numel() * t.element_size() for t in engine.model.kv_caches)
    grown = resident_bytes() - before
    engine.close()
    assert kv > 64 * 1024**2, f"KV cache of {kv / 1e6:.0f} MB: too small to show the difference"
    assert grown < kv // 2, f"engine start grew resident memory by {grown / 1e6:.0f} MB for a {kv / 1e6:.0f} MB KV cache"
