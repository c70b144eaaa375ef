"""The device layer: the only module of lora_conformance that names a device type.

Everything else asks this module for streams, events, synchronisation, memory figures
and graphs, so a new accelerator (XPU, a privateuse1 backend) works everywhere once it
works here. The seed bug this project exists for was a hard-coded ``torch.cuda`` stream
in an XPU LoRA path; ``tests/test_devices.py`` fails if another module names one.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import mmap
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

CPU, CUDA, XPU, NPU = "cpu", "cuda", "xpu", "npu"
ACCELERATOR_TYPES = (CUDA, XPU)  # probed, in this order, by ``auto``
# Device types with a marker shorthand (@pytest.mark.cuda) and a CI registration helper.
SHORTHAND_TYPES = (CPU, CUDA, XPU)
CI_HARDWARE = (CPU, CUDA, XPU, NPU)


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


# ---- device plugins: backends registered on request ------------------------------------

DEVICE_PLUGIN_GROUP = "lora_conformance.devices"
# Ours, so that a source checkout works before `pip install -e .` has written entry points.
_BUILTIN_DEVICE_PLUGINS = {"vdev": "lora_conformance.vdev:register"}


def device_plugins() -> dict[str, str]:
    """Device type -> ``module:function`` that registers it with torch (entry points add to ours)."""
    from importlib.metadata import entry_points

    found = dict(_BUILTIN_DEVICE_PLUGINS)
    for ep in entry_points(group=DEVICE_PLUGIN_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def register_device_plugin(device_type_: str) -> bool:
    """Register the plugin that provides ``device_type_``, if one does; True when one did.

    A device plugin is a function that makes its type a torch device in this process (and may
    be called again: it must be idempotent). Nothing registers a backend until a run names it.
    """
    target = device_plugins().get(device_type_)
    if target is None:
        return False
    module, _, attr = target.partition(":")
    try:
        register = getattr(importlib.import_module(module), attr or "register")
        register()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is the user's answer, said clearly
        raise DeviceError(f"device plugin {device_type_!r} ({target}) failed to register: {exc}") from exc
    return True


def _privateuse1_name() -> Optional[str]:
    torch = _torch()
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def device_module(device: "str | Any"):
    """The torch module for a device type: torch.cuda, torch.xpu, torch.cpu, or a vendor's."""
    torch = _torch()
    dtype_ = torch.device(device).type
    if dtype_ == "xpu" and not hasattr(torch, "xpu"):
        maybe_import_ipex(required=True)
    mod = getattr(torch, dtype_, None)
    if mod is None:
        raise DeviceError(f"torch has no module for device type {dtype_!r}")
    return mod


def is_available(device_type: str) -> bool:
    torch = _torch()
    if device_type == "cpu":
        return True
    if device_type == "xpu":
        maybe_import_ipex()
    mod = getattr(torch, device_type, None)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


def device_count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    if not is_available(device_type):
        return 0
    return int(device_module(device_type).device_count())


def resolve_device(spec: str, worker_index: Optional[int] = None) -> str:
    """Turn ``--device`` into a concrete torch device string.

    ``auto`` picks the first available accelerator, else cpu. A type without an index
    gets index ``worker_index mod device_count`` (pytest-xdist worker gwN -> device N).
    """
    spec = spec.strip()
    if spec == CPU:
        return CPU  # no torch import: a cpu run starts fast
    torch = _torch()
    if spec == "auto":
        candidates = list(ACCELERATOR_TYPES)
        pu1 = _privateuse1_name()
        if pu1:
            candidates.append(pu1)
        spec = next((t for t in candidates if is_available(t)), "cpu")
    register_device_plugin(spec.split(":", 1)[0])
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        raise DeviceError(f"{spec!r} is not a torch device ({exc})") from None
    if dev.type == "cpu":
        return "cpu"
    if not is_available(dev.type):
        raise DeviceError(f"device type {dev.type!r} is not available in this torch build/machine")
    count = device_count(dev.type)
    index = dev.index
    if index is None:
        index = (worker_index or 0) % max(count, 1)
    if index >= count:
        raise DeviceError(f"{spec!r}: index {index} but only {count} {dev.type} device(s)")
    return f"{dev.type}:{index}"


# OpenVINO's plugin for each device type it serves besides cpu: Intel GPUs are torch's "xpu"
# ("gpu", as OpenVINO spells it, is accepted too).
OPENVINO_PLUGINS = {"xpu": "GPU", "gpu": "GPU", "npu": "NPU"}


def device_type(device: str) -> str:
    return device.split(":", 1)[0]


def device_name(device: str) -> str:
    """Human-readable accelerator name for the report header."""
    if device_type(device) == "cpu":
        import platform

        return platform.processor() or platform.machine() or "cpu"
    mod = device_module(device)
    try:
        return str(mod.get_device_name(_torch().device(device)))
    except Exception:
        return device


def driver_version(device: str) -> str:
    torch = _torch()
    t = device_type(device)
    if t == "cuda":
        return f"cuda {torch.version.cuda}" if torch.version.cuda else f"hip {getattr(torch.version, 'hip', '?')}"
    if t == "xpu":
        try:
            return str(device_module(device).get_device_properties(torch.device(device)).driver_version)
        except Exception:
            return "unknown"
    return "n/a"


# ---- synchronisation, memory, seeding ------------------------------------------------


def synchronize(device: str) -> None:
    if device_type(device) != "cpu":
        device_module(device).synchronize(_torch().device(device))


def empty_cache(device: str) -> None:
    mod = device_module(device)
    if device_type(device) != "cpu" and hasattr(mod, "empty_cache"):
        mod.empty_cache()


# Below this a plain torch.zeros is as cheap (a few pages); above it the lazy mapping pays off.
LAZY_ZERO_MIN_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: Any, device: str):
    """``torch.zeros``, except that on cpu a large tensor lives in an anonymous memory mapping:
    the kernel hands out zero pages only where they are first written (calloc's trick), so a KV
    cache sized for the longest batch costs memory and time only for the blocks a run uses.
    (torch.zeros writes every byte: 134 MB and 0.14 s of cpu per built-in engine start.)"""
    torch = _torch()
    if device_type(device) != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < LAZY_ZERO_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds the mapping (buffer protocol) and unmaps it when it is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


@dataclass
class MemoryStats:
    allocated: int
    peak: int
    reserved: int


def memory_stats(device: str) -> MemoryStats:
    """Bytes allocated / peak / reserved on the device; zeros where torch does not track it (cpu)."""
    if device_type(device) == "cpu":
        return MemoryStats(0, 0, 0)
    mod = device_module(device)
    d = _torch().device(device)
    return MemoryStats(
        allocated=int(mod.memory_allocated(d)),
        peak=int(mod.max_memory_allocated(d)),
        reserved=int(getattr(mod, "memory_reserved", lambda _d: 0)(d)),
    )


def reset_peak_memory(device: str) -> None:
    if device_type(device) != "cpu":
        device_module(device).reset_peak_memory_stats(_torch().device(device))


def manual_seed(seed: int, device: Optional[str] = None) -> None:
    torch = _torch()
    torch.manual_seed(seed)
    if device is not None and device_type(device) != "cpu":
        device_module(device).manual_seed_all(seed)


# ---- streams and events -------------------------------------------------------------


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


def supports_streams(device: str) -> bool:
    return device_type(device) != "cpu" and hasattr(device_module(device), "Stream")


def new_stream(device: str):
    if not supports_streams(device):
        return _CpuStream()
    return device_module(device).Stream(device=_torch().device(device))


def current_stream(device: str):
    if not supports_streams(device):
        return _CpuStream()
    return device_module(device).current_stream(_torch().device(device))


def new_event(device: str):
    if not supports_streams(device):
        return _CpuEvent()
    return device_module(device).Event()


@contextlib.contextmanager
def stream_context(device: str, stream: Any) -> Iterator[None]:
    if not supports_streams(device) or isinstance(stream, _CpuStream):
        yield
        return
    with device_module(device).stream(stream):
        yield


def wait_event(device: str, event: Any, stream: Any = None) -> None:
    """Make ``stream`` (default: the current one) wait for ``event``."""
    if not supports_streams(device):
        return
    (stream or current_stream(device)).wait_event(event)


_PINNING: dict[str, bool] = {}


def pin_memory_supported(device: str) -> bool:
    """Whether host memory can be pinned for copies to ``device`` (asked once per type: a
    privateuse1 backend written in Python has no pinned-memory allocator)."""
    t = device_type(device)
    if t == "cpu":
        return False
    if t not in _PINNING:
        import warnings

        torch, dev = _torch(), _torch().device(device)
        try:
            with warnings.catch_warnings():  # naming the device is deprecated, but says which one we ask
                warnings.simplefilter("ignore", DeprecationWarning)
                _PINNING[t] = bool(torch.empty(1).pin_memory(dev).is_pinned(dev))
        except Exception:  # noqa: BLE001 - any refusal means no
            _PINNING[t] = False
    return _PINNING[t]


# ---- stream tracing (what the race detector listens to) -------------------------------

_STREAM_HANDLES = {"cuda": "cuda_stream", "xpu": "sycl_queue"}
# torch routes the trace of every GPU-like backend through one activator to torch.<type>._gpu_trace.
_TRACE_ACTIVATOR = "_activate_gpu_trace"


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


def stream_trace(device: str) -> Optional[StreamTrace]:
    """The trace hooks of ``device``'s type, or None where torch has none (cpu, most backends)."""
    t = device_type(device)
    handle = _STREAM_HANDLES.get(t)
    activate = getattr(_torch()._C, _TRACE_ACTIVATOR, None) if handle else None
    if not supports_streams(device) or activate is None:
        return None
    mod, dev = device_module(device), _torch().device(device)
    try:
        module = importlib.import_module(mod.__name__ + "._gpu_trace")
    except ImportError:
        return None
    capturing = getattr(mod, "is_current_stream_capturing", lambda: False)
    # called for every kernel while a detector watches: resolve the module and device once
    return StreamTrace(t, module, activate, lambda: int(getattr(mod.current_stream(dev), handle)), capturing)


# ---- graphs -------------------------------------------------------------------------

_GRAPH_CLASSES = {"cuda": "CUDAGraph", "xpu": "XPUGraph"}


def graphs_supported(device: str) -> bool:
    t = device_type(device)
    if t == "cpu":
        return False
    cls_name = _GRAPH_CLASSES.get(t)
    return cls_name is not None and hasattr(device_module(device), cls_name)


# Device types Triton compiles kernels for (the nvidia/amd backends serve "cuda", intel's "xpu").
_TRITON_TYPES = ("cuda", "xpu")
# Oldest CUDA compute capability whose Triton backend has bfloat16 tensor-core dots (Ampere).
_TRITON_MIN_CUDA_CAPABILITY = (8, 0)


def triton_backend(device: str) -> bool:
    """Whether Triton has a compiler backend for this device (importability is checked by callers).
    A bare device type (no index) is answered for the type's current device."""
    t = device_type(device)
    if t not in _TRITON_TYPES:
        return False
    if t == "cuda":
        try:
            return tuple(_torch().cuda.get_device_capability(device)) >= _TRITON_MIN_CUDA_CAPABILITY
        except Exception:  # noqa: BLE001 - no device to ask: no backend to use
            return False
    return True


def new_graph(device: str):
    if not graphs_supported(device):
        raise DeviceError(f"graph capture is not supported on {device}")
    return getattr(device_module(device), _GRAPH_CLASSES[device_type(device)])()


def graph_capture(device: str, graph: Any, pool: Any = None, stream: Any = None):
    """Context manager capturing into ``graph`` (torch.cuda.graph / torch.xpu.graph)."""
    mod = device_module(device)
    return mod.graph(graph, pool=pool, stream=stream)


def graph_pool_handle(device: str):
    return device_module(device).graph_pool_handle()


# ---- processes ----------------------------------------------------------------------


def needs_spawn(device: str) -> bool:
    """Accelerators cannot be re-initialised in a forked child; cpu can fork."""
    return device_type(device) != "cpu"


def set_start_method_for(device: str) -> None:
    if needs_spawn(device):
        try:
            multiprocessing.set_start_method("spawn", force=False)
        except RuntimeError:
            pass  # already set by the caller: respect it
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


# ---- collectives (tensor parallelism) -------------------------------------------------

_COLLECTIVE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}


def collective_backend(device: str) -> str:
    """The torch.distributed backend whose collectives run on ``device``'s tensors: gloo on cpu
    (ranks are processes), the vendor's library on accelerators (NCCL on CUDA). Raises
    DeviceError for a type without one."""
    kind = device_type(device)
    if kind not in _COLLECTIVE_BACKENDS:
        raise DeviceError(f"no torch.distributed collective backend is known for device type {kind!r}")
    return _COLLECTIVE_BACKENDS[kind]


def parallel_ranks(device_type_: str) -> int:
    """How many tensor-parallel ranks one host runs on this device type: one per device on
    accelerators; on cpu ranks are processes (gloo), one per core."""
    if device_type_ == "cpu":
        return os.cpu_count() or 1
    return device_count(device_type_)


def default_dtype_for(device: str) -> str:
    return "float32" if device_type(device) == "cpu" else "bfloat16"
