"""How an operation runs on ``vdev``: unwrap to host tensors, run torch's cpu kernel, wrap.

Two entry points reach :func:`run`:

* ``VdevTensor.__torch_dispatch__``, for every operation with a vdev tensor among its inputs;
* a ``torch.library`` fallback for the ``PrivateUse1`` dispatch key, for operations that name
  the device without a vdev input (``torch.empty(..., device="vdev")``, a host tensor's
  ``.to("vdev")``), plus an explicit ``_copy_from`` (torch reaches it with the Python key
  excluded, where a Python fallback kernel cannot be found).

Like a real device, vdev refuses an operation that mixes its tensors with host tensors (other
than 0-dim host scalars, host indices and copies), so an engine that forgets a ``.to(device)``
fails here as it would on an accelerator, instead of silently computing on the host.
"""

from __future__ import annotations

import torch

from lora_conformance.vdev import faults
from lora_conformance.vdev import tensor as _tensor_module
from lora_conformance.vdev.tensor import VdevTensor

aten = torch.ops.aten
CPU = torch.device("cpu")
_NAME = "vdev"

# Operations that move data between host and device, or take host index tensors as CUDA's do.
_HOST_ARGS_ALLOWED = {
    aten.copy_.default, aten._copy_from.default, aten._to_copy.default, aten._copy_from_and_resize.default,
    aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
    aten.set_.source_Tensor,
}


class _Scan:
    __slots__ = ("vdev", "host", "hosts", "cpu")

    def __init__(self) -> None:
        self.vdev = False
        self.host = None  # a non-scalar host tensor among the inputs
        self.hosts: dict[int, VdevTensor] = {}  # id(host tensor) -> its wrapper
        self.cpu: set[int] = set()  # ids of the host tensors passed in as such


def _unwrap(x, scan: _Scan):
    if isinstance(x, VdevTensor):
        scan.vdev = True
        scan.hosts[id(x.host)] = x
        return x.host
    if isinstance(x, torch.Tensor):
        if x.dim() > 0 and scan.host is None:
            scan.host = x
        scan.cpu.add(id(x))
        return x
    if isinstance(x, torch.device):
        return CPU if x.type == _NAME else x
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i, scan) for i in x)
    return x


def _wrap(x, scan: _Scan, to_device: bool):
    if isinstance(x, torch.Tensor) and not isinstance(x, VdevTensor):
        same = scan.hosts.get(id(x))
        if same is not None:
            if to_device and same.__dict__.get("_vdev_fresh"):
                same._vdev_fresh = False  # written in place: no longer a fresh allocation
            # an in-place operation, or ``to()`` with nothing to do, returns its input; moved to
            # the host, the values are copied (a device tensor never shares memory with one)
            return same if to_device else x.clone()
        if to_device and id(x) in scan.cpu:
            return VdevTensor(x.clone())
        return VdevTensor(x) if to_device else x
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(i, scan, to_device) for i in x)
    return x


def run(func, args, kwargs):
    scan = _Scan()
    hargs = _unwrap(args, scan)
    hkwargs = {k: _unwrap(v, scan) for k, v in kwargs.items()}
    if scan.vdev and scan.host is not None and func not in _HOST_ARGS_ALLOWED:
        raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found at least two "
                           f"devices, vdev:0 and {scan.host.device} (a host tensor of shape {tuple(scan.host.shape)})")
    target = kwargs.get("device")
    to_device = target.type == _NAME if isinstance(target, torch.device) else scan.vdev or target is None
    pending = _PENDING if _PENDING else None
    out = _FAULTY.get(func, _plain)(func, hargs, hkwargs, scan) if faults.active() else func(*hargs, **hkwargs)
    if func.is_view:
        base = args[0]
        if torch.is_inference_mode_enabled() and isinstance(base, VdevTensor) and not base.is_inference():
            # autograd shares the base's version counter with the view it gets back, which an
            # inference tensor has none of: make the view's wrapper a normal tensor, as its base is
            with torch.inference_mode(False):
                return _wrap(out, scan, to_device)
    elif pending and func is not aten.copy_.default:  # a copy writes: only reads see copies land
        _land_read(hargs, hkwargs)
    out = _wrap(out, scan, to_device)
    if func in _ALLOCATIONS and isinstance(out, VdevTensor):
        out._vdev_fresh = True  # see _async_copy
    return out


_tensor_module._run = run  # see tensor._run


def _plain(func, hargs, hkwargs, scan):
    return func(*hargs, **hkwargs)


# ---- faults ---------------------------------------------------------------------------

_PENDING: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination host tensor, value that lands)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _land_read(hargs, hkwargs) -> None:
    """async_h2d_copy: the copies whose destination the operation just read land now."""
    keys = set()
    for a in (*hargs, *hkwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                keys.add(_storage_key(t))
    landing = [p for p in _PENDING if _storage_key(p[0]) in keys]
    if landing:
        _PENDING[:] = [p for p in _PENDING if _storage_key(p[0]) not in keys]
        for dst, value in landing:
            dst.copy_(value)


def land_all() -> None:
    """What a synchronisation does: every copy in flight completes."""
    while _PENDING:
        dst, value = _PENDING.pop(0)
        dst.copy_(value)


_K_TILE = 1  # the faulty unit rounds its accumulator after every product
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default}


def _async_copy(func, hargs, hkwargs, scan):
    """async_h2d_copy: a copy from the host into device memory that already holds values (a weight
    slot, a buffer) is queued; filling a fresh allocation (``.to(device)``, ``torch.tensor(...,
    device=...)``) stays synchronous, as a backend's staging path for new tensors would be."""
    dst, src = hargs[0], hargs[1]
    wrapper = scan.hosts.get(id(dst))
    if wrapper is not None and getattr(wrapper, "_vdev_fresh", False):
        wrapper._vdev_fresh = False
        return func(*hargs, **hkwargs)
    if wrapper is not None and id(src) not in scan.hosts and faults.on("async_h2d_copy"):
        _PENDING.append((dst, src.to(dst.dtype).expand_as(dst).clone()))  # staged now, lands later
        return dst
    return func(*hargs, **hkwargs)


def _bf16_accumulating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with the running sum kept in bfloat16: rounded after every product is added."""
    acc = None
    for k in range(0, a.shape[-1], _K_TILE):
        part = a[..., k:k + _K_TILE].float() @ b[..., k:k + _K_TILE, :].float()
        acc = part.bfloat16() if acc is None else (acc.float() + part).bfloat16()
    return acc


def _matmul(func, hargs, hkwargs, scan):
    if not faults.on("bf16_matmul_accumulate") or any(
            isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16 for t in hargs[:3]):
        return func(*hargs, **hkwargs)
    if func in (aten.mm.default, aten.bmm.default):
        return _bf16_accumulating(hargs[0], hargs[1])
    bias, a, b = hargs[:3]  # addmm / baddbmm: beta * bias + alpha * (a @ b)
    beta, alpha = hkwargs.get("beta", 1), hkwargs.get("alpha", 1)
    return (beta * bias.float() + alpha * _bf16_accumulating(a, b).float()).bfloat16()


_WRAP_AT = 512


def _wrapping_index(func, hargs, hkwargs, scan):
    if not faults.on("index_select_wraps"):
        return func(*hargs, **hkwargs)
    if func is aten.embedding.default:
        weight, idx = hargs[0], hargs[1]
        return func(weight, torch.where(idx >= _WRAP_AT, idx % _WRAP_AT, idx), *hargs[2:], **hkwargs)
    src, dim, idx = hargs[0], hargs[1], hargs[2]
    return func(src, dim, torch.where(idx >= _WRAP_AT, idx % _WRAP_AT, idx), **hkwargs)


_ROWS_PER_BLOCK = 4
_ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten._softmax.default, aten._log_softmax.default,
                   aten.softmax.int, aten.log_softmax.int}


def _dropping_tail(func, hargs, hkwargs, scan):
    """A row-wise reduction over the last dimension launched with rows // 4 blocks of 4 rows
    instead of ceil(rows / 4): the last partial block is never computed and stays zero."""
    out = func(*hargs, **hkwargs)
    if not faults.on("reduction_drops_tail"):
        return out
    x = hargs[0]
    dims = hargs[1] if len(hargs) > 1 else hkwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if len(dims) != 1 or dims[0] % x.dim() != x.dim() - 1 or not x.is_floating_point():
        return out
    rows = x.numel() // max(x.shape[-1], 1)
    tail = rows % _ROWS_PER_BLOCK
    if tail == 0 or rows < _ROWS_PER_BLOCK:
        return out
    flat = out.reshape(rows, -1) if out.numel() else out
    flat[rows - tail:] = 0
    return flat.reshape(out.shape)


_FAULTY = {
    aten.copy_.default: _async_copy,
    aten.mm.default: _matmul, aten.bmm.default: _matmul, aten.addmm.default: _matmul,
    aten.baddbmm.default: _matmul,
    aten.index_select.default: _wrapping_index, aten.embedding.default: _wrapping_index,
    **{op: _dropping_tail for op in _ROW_REDUCTIONS},
}


# ---- registration ---------------------------------------------------------------------

_LIBS: list = []


def _fallback(keyset, func, *args, **kwargs):
    return run(func, args, kwargs)


def _copy_from(src, dst, non_blocking=False):
    run(aten.copy_.default, (dst, src), {"non_blocking": non_blocking})
    return dst


def install() -> None:
    """Register the PrivateUse1 fallback and the explicit kernels, once per process."""
    if _LIBS:
        return
    from lora_conformance.vdev import tensor

    tensor.DEVICE = torch.device(_NAME, 0)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, dispatch_key="PrivateUse1", with_keyset=True)
    explicit = torch.library.Library("aten", "IMPL")
    explicit.impl("_copy_from", _copy_from, "PrivateUse1")
    _LIBS.extend([fallback, explicit])
