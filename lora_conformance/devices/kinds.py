"""What each device kind does: one class per kind, as torch's own test suite has CPUTestBase,
CUDATestBase, ... ``DeviceKind`` is what torch offers every accelerator through its ``torch.<type>``
module; ``Cpu``, ``Cuda``, ``Xpu``, ``Npu``, ``Hpu`` and ``Vendor`` (a privateuse1 backend such as
vdev, or any type no class names) say only where theirs differs. ``KINDS`` is the table of them and
``kind_of`` the instance for a device string. Standard library only until a method asks torch.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

CPU, CUDA, XPU, NPU = "cpu", "cuda", "xpu", "npu"


class DeviceError(ValueError):
    pass


def _torch():
    import torch

    return torch


def maybe_import_ipex(required: bool = False) -> bool:
    """Import intel-extension-for-pytorch when present (recent torch has torch.xpu without it)."""
    try:
        importlib.import_module("intel_extension_for_pytorch")
        return True
    except ImportError as exc:
        if required:
            raise DeviceError(
                "intel-extension-for-pytorch was asked for but is not importable "
                f"({exc}); install the 'xpu' extra: pip install 'lora-conformance[xpu]'"
            ) from exc
        return False


# ---- what the kinds hand out ----------------------------------------------------------------

# Below this a plain torch.zeros is as cheap (a few pages); above it the lazy mapping pays off.
LAZY_ZERO_MIN_BYTES = 1 << 20
# torch routes the trace of every GPU-like backend through one activator to torch.<type>._gpu_trace.
_TRACE_ACTIVATOR = "_activate_gpu_trace"


@dataclass
class MemoryStats:
    allocated: int
    peak: int
    reserved: int
    peak_reserved: int = 0  # the most the caching allocator held at once (reserved where not tracked)


class _CpuStream:
    """Stand-in for devices that execute in order (cpu): every operation is a no-op."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass(frozen=True)
class StreamTrace:
    """A device type's stream/event/memory trace hooks (``torch.<type>._gpu_trace``).

    ``module`` has the ``register_callback_for_*`` functions; ``stream_id()`` is the current
    stream's handle as the trace reports it; ``capturing()`` says whether graph capture is on
    (kernels recorded into a graph do not run when they are launched).
    """

    device_type: str
    module: Any
    activate: Any
    stream_id: Any
    capturing: Any


# ---- device kinds: one class each -------------------------------------------------------------


class DeviceKind:
    """An accelerator as torch's ``torch.<type>`` module serves it: the behaviour every kind has
    unless its class says otherwise. Methods take the full device string ("xpu:1") where torch
    asks which device; one instance per type (``kind_of``), so what it probes is asked once."""

    graph_class: ClassVar[Optional[str]] = None  # torch.<type>.<graph_class> captures graphs
    stream_handle: ClassVar[Optional[str]] = None  # the stream attribute the trace reports streams by
    collective: ClassVar[Optional[str]] = None  # torch.distributed backend for this type's tensors
    openvino_plugin: ClassVar[Optional[str]] = None  # OpenVINO's plugin for this type
    default_dtype: ClassVar[str] = "bfloat16"
    needs_spawn: ClassVar[bool] = True  # accelerators cannot be re-initialised in a forked child

    def __init__(self, name: str) -> None:
        self.name = name
        self._pinning: Optional[bool] = None

    def module(self):
        """torch.<type>: torch.cuda, torch.xpu, torch.cpu, or a vendor's."""
        mod = getattr(_torch(), self.name, None)
        if mod is None:
            raise DeviceError(f"torch has no module for device type {self.name!r}")
        return mod

    def is_available(self) -> bool:
        mod = getattr(_torch(), self.name, None)
        try:
            return bool(mod is not None and mod.is_available())
        except Exception:
            return False

    def device_count(self) -> int:
        return int(self.module().device_count()) if self.is_available() else 0

    def parallel_ranks(self) -> int:
        """Tensor-parallel ranks one host runs: one per device."""
        return self.device_count()

    def device_name(self, device: str) -> str:
        mod = self.module()
        try:
            return str(mod.get_device_name(_torch().device(device)))
        except Exception:
            return device

    def driver_version(self, device: str) -> str:
        return "n/a"

    def synchronize(self, device: str) -> None:
        self.module().synchronize(_torch().device(device))

    def empty_cache(self) -> None:
        mod = self.module()
        if hasattr(mod, "empty_cache"):
            mod.empty_cache()

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: str):
        return _torch().zeros(shape, dtype=dtype, device=device)

    def memory_stats(self, device: str) -> MemoryStats:
        mod, d = self.module(), _torch().device(device)
        reserved = int(getattr(mod, "memory_reserved", lambda _d: 0)(d))
        return MemoryStats(
            allocated=int(mod.memory_allocated(d)),
            peak=int(mod.max_memory_allocated(d)),
            reserved=reserved,
            peak_reserved=int(getattr(mod, "max_memory_reserved", lambda _d: reserved)(d)),
        )

    def total_memory(self, device: str) -> Optional[int]:
        """Bytes of memory the device has (its properties' ``total_memory``), None where unknown.
        Initialises the device's runtime as ``device_name`` does (the report header asks that in
        pytest's controlling process too)."""
        try:
            return int(self.module().get_device_properties(_torch().device(device)).total_memory)
        except Exception:
            return None

    def initialized(self) -> bool:
        """Whether this process has started the device's runtime (asking for memory figures must
        not start it: a process that never used the device has none)."""
        return bool(getattr(self.module(), "is_initialized", lambda: True)())

    def reset_peak_memory(self, device: str) -> None:
        self.module().reset_peak_memory_stats(_torch().device(device))

    def manual_seed_all(self, seed: int) -> None:
        self.module().manual_seed_all(seed)

    # streams and events: in-order stand-ins where the module has no Stream
    def supports_streams(self) -> bool:
        return hasattr(self.module(), "Stream")

    def new_stream(self, device: str):
        if not self.supports_streams():
            return _CpuStream()
        return self.module().Stream(device=_torch().device(device))

    def current_stream(self, device: str):
        if not self.supports_streams():
            return _CpuStream()
        return self.module().current_stream(_torch().device(device))

    def new_event(self):
        return self.module().Event() if self.supports_streams() else _CpuEvent()

    def stream_context(self, stream: Any):
        if not self.supports_streams() or isinstance(stream, _CpuStream):
            return contextlib.nullcontext()
        return self.module().stream(stream)

    def wait_event(self, device: str, event: Any, stream: Any = None) -> None:
        if self.supports_streams():
            (stream or self.current_stream(device)).wait_event(event)

    def pin_memory_supported(self, device: str) -> bool:
        """Probed once (a privateuse1 backend written in Python has no pinned-memory allocator)."""
        if self._pinning is None:
            import warnings

            torch, dev = _torch(), _torch().device(device)
            try:
                with warnings.catch_warnings():  # naming the device is deprecated, but says which one we ask
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._pinning = bool(torch.empty(1).pin_memory(dev).is_pinned(dev))
            except Exception:  # noqa: BLE001 - any refusal means no
                self._pinning = False
        return self._pinning

    def stream_trace(self, device: str) -> Optional[StreamTrace]:
        handle = self.stream_handle
        activate = getattr(_torch()._C, _TRACE_ACTIVATOR, None) if handle else None
        if not self.supports_streams() or activate is None:
            return None
        mod, dev = self.module(), _torch().device(device)
        try:
            module = importlib.import_module(mod.__name__ + "._gpu_trace")
        except ImportError:
            return None
        capturing = getattr(mod, "is_current_stream_capturing", lambda: False)
        # called for every kernel while a detector watches: resolve the module and device once
        return StreamTrace(self.name, module, activate, lambda: int(getattr(mod.current_stream(dev), handle)), capturing)

    # graphs, kernels, collectives
    def graphs_supported(self) -> bool:
        return self.graph_class is not None and hasattr(self.module(), self.graph_class)

    def new_graph(self, device: str):
        if not self.graphs_supported():
            raise DeviceError(f"graph capture is not supported on {device}")
        return getattr(self.module(), self.graph_class)()

    def triton_backend(self, device: str) -> bool:
        return False

    def collective_backend(self) -> str:
        if self.collective is None:
            raise DeviceError(f"no torch.distributed collective backend is known for device type {self.name!r}")
        return self.collective


class Cpu(DeviceKind):
    """The host: always there, in order (no streams, events or graphs), memory untracked, forks."""

    collective = "gloo"  # ranks are processes
    default_dtype = "float32"
    needs_spawn = False

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def parallel_ranks(self) -> int:
        return os.cpu_count() or 1  # ranks are processes (gloo), one per core

    def device_name(self, device: str) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def synchronize(self, device: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def zeros(self, shape: tuple[int, ...], dtype: Any, device: str):
        """A large tensor lives in an anonymous memory mapping: the kernel hands out zero pages only
        where they are first written (calloc's trick), so a KV cache sized for the longest batch
        costs memory and time only for the blocks a run uses. (torch.zeros writes every byte:
        134 MB and 0.14 s of cpu per built-in engine start.)"""
        torch = _torch()
        count = math.prod(shape)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if nbytes < LAZY_ZERO_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype)
        # The tensor holds the mapping (buffer protocol) and unmaps it when it is freed.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)

    def memory_stats(self, device: str) -> MemoryStats:
        return MemoryStats(0, 0, 0)

    def total_memory(self, device: str) -> Optional[int]:
        return None  # host memory: parallel.available_memory

    def initialized(self) -> bool:
        return False  # host memory: torch keeps no device figures for it

    def reset_peak_memory(self, device: str) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass  # torch.manual_seed seeds it

    def supports_streams(self) -> bool:
        return False

    def pin_memory_supported(self, device: str) -> bool:
        return False


class Cuda(DeviceKind):
    """NVIDIA (and ROCm, which torch serves as "cuda")."""

    graph_class, stream_handle, collective = "CUDAGraph", "cuda_stream", "nccl"
    # Oldest compute capability whose Triton backend has bfloat16 tensor-core dots (Ampere).
    triton_min_capability = (8, 0)

    def driver_version(self, device: str) -> str:
        version = _torch().version
        return f"cuda {version.cuda}" if version.cuda else f"hip {getattr(version, 'hip', '?')}"

    def triton_backend(self, device: str) -> bool:
        try:
            return tuple(self.module().get_device_capability(device)) >= self.triton_min_capability
        except Exception:  # noqa: BLE001 - no device to ask: no backend to use
            return False


class Xpu(DeviceKind):
    """Intel GPUs: torch.xpu, from intel-extension-for-pytorch on a torch too old to have it."""

    graph_class, stream_handle, collective, openvino_plugin = "XPUGraph", "sycl_queue", "xccl", "GPU"

    def module(self):
        if not hasattr(_torch(), self.name):
            maybe_import_ipex(required=True)
        return super().module()

    def is_available(self) -> bool:
        maybe_import_ipex()
        return super().is_available()

    def driver_version(self, device: str) -> str:
        try:
            return str(self.module().get_device_properties(_torch().device(device)).driver_version)
        except Exception:
            return "unknown"

    def triton_backend(self, device: str) -> bool:
        return True  # intel's Triton backend


class Npu(DeviceKind):
    """Neural processing units (torch.npu from the vendor's extension; OpenVINO's NPU plugin)."""

    openvino_plugin = "NPU"


class Hpu(DeviceKind):
    """Gaudi (torch.hpu from habana's extension)."""

    collective = "hccl"


class Vendor(DeviceKind):
    """A backend in torch's privateuse1 slot (vdev, a vendor's), registered by its device plugin
    when a run names it, or any other type no class names: the generic behaviour, with what it
    may lack (pinned memory, trace hooks, graphs) probed or refused."""

    @staticmethod
    def privateuse1_name() -> Optional[str]:
        name = _torch()._C._get_privateuse1_backend_name()
        return None if name == "privateuseone" else name


KINDS: dict[str, type[DeviceKind]] = {CPU: Cpu, CUDA: Cuda, XPU: Xpu, NPU: Npu, "hpu": Hpu}
_INSTANCES: dict[str, DeviceKind] = {}


def device_type(device: str) -> str:
    return device.split(":", 1)[0]


def kind_of(device: str) -> DeviceKind:
    """The kind of ``device``'s type (a device string or a bare type)."""
    t = device_type(device)
    if t not in _INSTANCES:
        _INSTANCES[t] = KINDS.get(t, Vendor)(t)
    return _INSTANCES[t]
