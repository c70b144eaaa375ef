"""The device layer: the only place in lora_conformance that names a device type.

Everything else asks this package for streams, events, synchronisation, memory figures
and graphs, so a new accelerator (XPU, a privateuse1 backend) works everywhere once it
works here. The seed bug this project exists for was a hard-coded ``torch.cuda`` stream
in an XPU LoRA path; ``tests/test_devices.py`` fails if another module names one.

What each device kind does is its class in ``kinds`` (one per kind); the functions here take a
device string and hand over to the kind of its type, and resolve ``--device`` and device plugins.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Optional

from lora_conformance.devices.kinds import (  # the kinds' names are the device layer's too
    CPU,
    CUDA,
    KINDS,
    LAZY_ZERO_MIN_BYTES,
    NPU,
    XPU,
    DeviceError,
    DeviceKind,
    MemoryStats,
    StreamTrace,
    Vendor,
    _torch,
    device_type,
    kind_of,
    maybe_import_ipex,
)

ACCELERATOR_TYPES = (CUDA, XPU)  # probed, in this order, by ``auto``
# Device types with a marker shorthand (@pytest.mark.cuda) and a CI registration helper.
SHORTHAND_TYPES = (CPU, CUDA, XPU)
CI_HARDWARE = (CPU, CUDA, XPU, NPU)


# ---- device plugins: backends registered on request ------------------------------------

DEVICE_PLUGIN_GROUP = "lora_conformance.devices"
# Ours, so that a source checkout works before `pip install -e .` has written entry points.
_BUILTIN_DEVICE_PLUGINS = {"vdev": "lora_conformance.vdev:register"}


def device_plugins() -> dict[str, str]:
    """Device type -> ``module:function`` that registers it with torch (entry points add to ours)."""
    from lora_conformance.entry_points import targets

    return targets(DEVICE_PLUGIN_GROUP, _BUILTIN_DEVICE_PLUGINS)


def register_device_plugin(device_type_: str) -> bool:
    """Register the plugin that provides ``device_type_``, if one does; True when one did.

    A device plugin is a function that makes its type a torch device in this process (and may
    be called again: it must be idempotent). Nothing registers a backend until a run names it.
    """
    target = device_plugins().get(device_type_)
    if target is None:
        return False
    from lora_conformance.entry_points import load

    try:
        register = load(target, "register")
        register()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is the user's answer, said clearly
        raise DeviceError(f"device plugin {device_type_!r} ({target}) failed to register: {exc}") from exc
    return True


# OpenVINO's plugin for each device type it serves besides cpu (Intel GPUs are torch's "xpu";
# "gpu", as OpenVINO spells it, is accepted too).
OPENVINO_PLUGINS = {"gpu": "GPU", **{t: k.openvino_plugin for t, k in KINDS.items() if k.openvino_plugin}}


# ---- the layer's functions: each hands over to the kind of the device's type -------------------


def device_module(device: "str | Any"):
    """The torch module for a device type: torch.cuda, torch.xpu, torch.cpu, or a vendor's."""
    return kind_of(_torch().device(device).type).module()


def is_available(device_type: str) -> bool:
    return kind_of(device_type).is_available()


def device_count(device_type: str) -> int:
    return kind_of(device_type).device_count()


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
        pu1 = Vendor.privateuse1_name()
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


def device_name(device: str) -> str:
    """Human-readable accelerator name for the report header."""
    return kind_of(device).device_name(device)


def driver_version(device: str) -> str:
    return kind_of(device).driver_version(device)


def default_dtype_for(device: str) -> str:
    return kind_of(device).default_dtype


def synchronize(device: str) -> None:
    kind_of(device).synchronize(device)


def empty_cache(device: str) -> None:
    kind_of(device).empty_cache()


def zeros(shape: tuple[int, ...], dtype: Any, device: str):
    """``torch.zeros``, except that on cpu a large tensor's pages are paid for only where written."""
    return kind_of(device).zeros(shape, dtype, device)


def memory_stats(device: str) -> MemoryStats:
    """Bytes allocated / peak / reserved on the device; zeros where torch does not track it (cpu)."""
    return kind_of(device).memory_stats(device)


def total_memory(device: str) -> Optional[int]:
    """Bytes of memory the accelerator has; None on cpu or where unknown."""
    return kind_of(device).total_memory(device)


def reset_peak_memory(device: str) -> None:
    kind_of(device).reset_peak_memory(device)


def memory_peaks(device: str) -> Optional[dict[str, int]]:
    """This process's most device memory at once, in bytes (``peak_allocated`` by tensors,
    ``peak_reserved`` by the caching allocator), as torch's allocator counts it; None on cpu or
    where this process never started the device's runtime."""
    kind = kind_of(device)
    if not kind.initialized():
        return None
    stats = kind.memory_stats(device)
    return {"peak_allocated": stats.peak, "peak_reserved": max(stats.peak_reserved, stats.peak)}


def manual_seed(seed: int, device: Optional[str] = None) -> None:
    _torch().manual_seed(seed)
    if device is not None:
        kind_of(device).manual_seed_all(seed)


def supports_streams(device: str) -> bool:
    return kind_of(device).supports_streams()


def new_stream(device: str):
    return kind_of(device).new_stream(device)


def current_stream(device: str):
    return kind_of(device).current_stream(device)


def new_event(device: str):
    return kind_of(device).new_event()


def stream_context(device: str, stream: Any):
    """Context manager making ``stream`` current (nothing on a device that runs in order)."""
    return kind_of(device).stream_context(stream)


def wait_event(device: str, event: Any, stream: Any = None) -> None:
    """Make ``stream`` (default: the current one) wait for ``event``."""
    kind_of(device).wait_event(device, event, stream)


def pin_memory_supported(device: str) -> bool:
    """Whether host memory can be pinned for copies to ``device`` (asked once per type)."""
    return kind_of(device).pin_memory_supported(device)


def stream_trace(device: str) -> Optional[StreamTrace]:
    """The trace hooks of ``device``'s type, or None where torch has none (cpu, most backends)."""
    return kind_of(device).stream_trace(device)


def graphs_supported(device: str) -> bool:
    return kind_of(device).graphs_supported()


def new_graph(device: str):
    return kind_of(device).new_graph(device)


def graph_capture(device: str, graph: Any, pool: Any = None, stream: Any = None):
    """Context manager capturing into ``graph`` (torch.cuda.graph / torch.xpu.graph)."""
    return device_module(device).graph(graph, pool=pool, stream=stream)


def graph_pool_handle(device: str):
    return device_module(device).graph_pool_handle()


def triton_backend(device: str) -> bool:
    """Whether Triton has a compiler backend for this device (importability is checked by callers).
    A bare device type (no index) is answered for the type's current device."""
    return kind_of(device).triton_backend(device)


def needs_spawn(device: str) -> bool:
    """Accelerators cannot be re-initialised in a forked child; cpu can fork."""
    return kind_of(device).needs_spawn


def set_start_method_for(device: str) -> None:
    if needs_spawn(device):
        try:
            multiprocessing.set_start_method("spawn", force=False)
        except RuntimeError:
            pass  # already set by the caller: respect it
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def collective_backend(device: str) -> str:
    """The torch.distributed backend whose collectives run on ``device``'s tensors: gloo on cpu
    (ranks are processes), the vendor's library on accelerators (NCCL on CUDA). Raises
    DeviceError for a type without one."""
    return kind_of(device).collective_backend()


def parallel_ranks(device_type_: str) -> int:
    """How many tensor-parallel ranks one host runs on this device type: one per device on
    accelerators; on cpu ranks are processes (gloo), one per core."""
    return kind_of(device_type_).parallel_ranks()
