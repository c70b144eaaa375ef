"""The ``vdev`` tensor: a wrapper whose device is ``vdev:0`` over an ordinary host tensor.

``torch.Tensor._make_wrapper_subclass`` gives a tensor with shape, strides, dtype and device but
no storage; the host tensor holding the values hangs off it as ``.host``. A view of a vdev
tensor wraps a view of its host tensor, so aliasing (in-place writes through views, slices of
a KV cache) behaves as on any device. Code that asks a vdev tensor for its storage or
``data_ptr()`` gets torch's error for storage-less tensors: a vendor backend has real pointers,
this one does not.

Memory statistics count the bytes of the host storages that live vdev tensors hold: a storage
is counted once, however many views of it are alive, until its last vdev tensor is freed.
"""

from __future__ import annotations

import weakref

import torch

DEVICE = torch.device("privateuseone", 0)  # replaced by register(): "vdev:0"


class VdevTensor(torch.Tensor):
    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, host.size(), strides=host.stride(), storage_offset=host.storage_offset(),
            dtype=host.dtype, layout=host.layout, device=DEVICE, requires_grad=False,
            dispatch_sizes_strides_policy="sizes",
        )
        out.host = host
        _MEMORY.hold(out, host)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{self.host!r}".replace("tensor(", "vdev_tensor(", 1)

    # ``p.data = q`` makes p's tensor metadata q's (torch copies it at the C++ level); the host
    # tensor must follow, or p would keep its old values under its new dtype and shape.
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        if not isinstance(value, VdevTensor):
            raise RuntimeError(f"vdev: cannot set .data of a vdev tensor to a {value.device} tensor")
        torch.Tensor.data.__set__(self, value)
        self.host = value.host
        _MEMORY.rehold(self, value.host)

    def tolist(self):
        # torch refuses tolist() on every tensor subclass; a device tensor answers it via the host.
        return self.cpu().tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        meta = _METADATA.get(func)
        if meta is not None:
            return meta(args[0].host, *args[1:])
        return _run(func, args, kwargs or {})


# The kernels of the import of this package that this class belongs to (kernels.py sets it when
# it is imported): looked up through ``sys.modules`` instead, a second import of the package
# would send this class's tensors to kernels that do not know them as device tensors.
_run = None


# Sizes and strides are asked of the host tensor (the wrapper is made with the "sizes" policy):
# an out= kernel that resizes its output (torch.arange's does) resizes the host tensor, and the
# wrapper must follow it.
_aten = torch.ops.aten
_METADATA = {
    _aten.sym_size.default: lambda h: h.size(),
    _aten.sym_stride.default: lambda h: h.stride(),
    _aten.dim.default: lambda h: h.dim(),
    _aten.sym_numel.default: lambda h: h.numel(),
    _aten.sym_storage_offset.default: lambda h: h.storage_offset(),
    _aten.is_contiguous.default: lambda h: h.is_contiguous(),
    _aten.is_contiguous.memory_format: lambda h, fmt: h.is_contiguous(memory_format=fmt),
    _aten.is_strides_like_format.default: lambda h, fmt: h.is_contiguous(memory_format=fmt),
    _aten.is_non_overlapping_and_dense.default: lambda h: h.is_contiguous() or h.t().is_contiguous(),
}


class _Memory:
    """Bytes of host storage held by live vdev tensors, and the peak since the last reset.

    A finalizer may run inside any allocation (the garbage collector runs where it likes), so it
    only queues the freed storage; the books are settled before each allocation and each read.
    No lock: under the GIL a list append and pop are atomic.
    """

    def __init__(self) -> None:
        self.holders: dict[int, list[int]] = {}  # storage data pointer -> [nbytes, live wrappers]
        self.freed: list[int] = []
        self._allocated = 0
        self._peak = 0

    def _count(self, host: torch.Tensor) -> int:
        """One more holder of ``host``'s storage (its bytes counted on the first); its key."""
        storage = host.untyped_storage()
        key = storage.data_ptr()
        entry = self.holders.get(key)
        if entry is None:
            self.holders[key] = [storage.nbytes(), 1]
            self._allocated += storage.nbytes()
            self._peak = max(self._peak, self._allocated)
        else:
            entry[1] += 1
        return key

    def hold(self, wrapper: torch.Tensor, host: torch.Tensor) -> None:
        self._settle()
        cell = [self._count(host)]  # the storage this wrapper holds (``rehold`` changes it)
        wrapper._vdev_held = cell
        weakref.finalize(wrapper, self._queue_free, cell)

    def _queue_free(self, cell: list[int]) -> None:
        self.freed.append(cell[0])

    def rehold(self, wrapper: torch.Tensor, host: torch.Tensor) -> None:
        """``wrapper`` now holds ``host``'s storage instead of the one it held."""
        cell = wrapper._vdev_held
        self._settle()
        key = self._count(host)
        self.freed.append(cell[0])
        cell[0] = key
        self._settle()

    def _settle(self) -> None:
        while self.freed:
            key = self.freed.pop()
            entry = self.holders.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self.holders[key]
                self._allocated -= entry[0]

    @property
    def allocated(self) -> int:
        self._settle()
        return self._allocated

    @property
    def peak(self) -> int:
        self._settle()
        return self._peak

    def reset_peak(self) -> None:
        self._settle()
        self._peak = self._allocated


_MEMORY = _Memory()


def memory() -> _Memory:
    return _MEMORY
