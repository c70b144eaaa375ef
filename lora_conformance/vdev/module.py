"""``torch.vdev``: the device module the device layer (``lora_conformance/devices/``) asks.

Every answer is honest about the device being a Python program on the host:

* one device (``vdev:0``); ``set_device`` accepts only 0;
* ``synchronize`` completes every copy in flight (only the ``async_h2d_copy`` fault leaves any);
* seeds go to the host generator, which is the one vdev's kernels draw from;
* streams and events exist because engines overlap work with them, but vdev runs every
  operation synchronously in the order it is called: waits are satisfied when made, an event
  is complete once recorded, and ``elapsed_time`` is the host time between two records;
* memory figures are the bytes of host storage held by live vdev tensors (``tensor.py``);
  nothing is reserved beyond that, so ``memory_reserved`` equals ``memory_allocated``;
* no graph capture and no stream trace: those attributes are absent, which is how the device
  layer tells what a device lacks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import torch

from lora_conformance.vdev import faults, kernels, tensor


class Stream:
    """A stream label on an in-order device: nothing it orders can be out of order."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = tensor.DEVICE
        self.priority = priority

    def wait_event(self, event: "Event") -> None:
        pass  # the event's work ran when it was issued

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def synchronize(self) -> None:
        kernels.land_all()

    def query(self) -> bool:
        return True

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time: Optional[float] = None

    def record(self, stream: Optional[Stream] = None) -> None:
        self.time = time.perf_counter()

    def wait(self, stream: Optional[Stream] = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        kernels.land_all()

    def elapsed_time(self, end: "Event") -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("vdev Event.elapsed_time: both events must have been recorded")
        return (end.time - self.time) * 1000.0


_DEFAULT_STREAM: Optional[Stream] = None  # made at registration, once "vdev" is a device type


class VdevModule:
    """What ``torch.vdev`` is: the functions torch and the device layer look up by name."""

    Stream = Stream
    Event = Event

    def __init__(self) -> None:
        self._current: Optional[Stream] = None

    # -- what torch's privateuse1 registration asks
    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        if index not in (None, 0):
            raise RuntimeError(f"vdev has one device (vdev:0), not vdev:{index}")

    def get_device_name(self, device: Any = None) -> str:
        fault = faults.active()
        return "vdev (virtual accelerator in Python, host kernels)" + (f", fault {fault}" if fault else "")

    def synchronize(self, device: Any = None) -> None:
        kernels.land_all()

    # -- seeds: vdev's kernels draw from the host generator
    # (torch.manual_seed calls manual_seed_all here: seed the host generator itself, not through it)
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def seed(self) -> None:
        torch.default_generator.seed()

    def seed_all(self) -> None:
        torch.default_generator.seed()

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    # -- streams
    def current_stream(self, device: Any = None) -> Stream:
        return self._current or self.default_stream()

    def default_stream(self, device: Any = None) -> Stream:
        global _DEFAULT_STREAM
        if _DEFAULT_STREAM is None:
            _DEFAULT_STREAM = Stream()
        return _DEFAULT_STREAM

    @contextlib.contextmanager
    def stream(self, stream: Optional[Stream]):
        previous, self._current = self._current, stream or self.current_stream()
        try:
            yield
        finally:
            self._current = previous

    # -- memory: bytes of host storage held by live vdev tensors
    def memory_allocated(self, device: Any = None) -> int:
        return tensor.memory().allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return tensor.memory().peak

    def memory_reserved(self, device: Any = None) -> int:
        return tensor.memory().allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        tensor.memory().reset_peak()

    def empty_cache(self) -> None:
        pass  # no caching allocator: freed host storage goes straight back to the host
