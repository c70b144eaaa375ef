"""A stream race detector: happens-before checking of device memory accesses across streams.

A missing wait between a side stream that writes memory (an adapter copied into its slot) and
the compute stream that reads it is a race that output comparisons can miss for ever: on a fast
accelerator the copy usually lands before the read. This detector does not wait for the race
to show. It records every device kernel's reads and writes (a torch dispatch mode: the
operator schema says which arguments are written) and every cross-stream ordering the program
establishes (the device's trace hooks: event record / wait, stream / event / device
synchronisation), and reports each pair of conflicting accesses that nothing orders.

Ordering is tracked with vector clocks: each stream's clock says, for every stream, up to
which of its kernels it is ordered after. An event carries the clock of its stream when
recorded; waiting on it merges that clock; a host synchronisation merges the synchronised
stream's clock into the host's, which every later launch inherits.

Accesses are byte ranges of a storage: a write to one slot of a pool and a read of the whole
pool conflict; writes to two different slots do not. An indexing kernel that reads a whole
pool counts as reading all of it (the detector cannot know which rows the indices pick), so an
engine that writes one slot while kernels gather from the same pool on another stream, with no
ordering between them, is reported: that is a real hazard unless the engine proves otherwise.

Only work done by torch operators in this process is seen: an engine whose device work runs in
other processes gives ``launches == 0``, and callers must treat that as "not observed", never
as "race-free". Kernels captured into a graph are not recorded (they do not run at capture).

    detector = RaceDetector.for_device(device)   # None where the device has no trace hooks
    with detector.watching():
        engine.generate(requests)
    assert detector.launches > 0 and not detector.races, detector.describe()
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional

from lora_conformance import devices

MAX_REPORTED = 20


@dataclass(frozen=True)
class Access:
    kind: str  # "read" | "write"
    lo: int
    hi: int
    stream: int
    seq: int
    op: str
    where: str

    def describe(self) -> str:
        return f"{self.kind} by {self.op} on stream {self.stream:#x} (kernel #{self.seq} there) at {self.where}"


@dataclass(frozen=True)
class Race:
    storage: int
    earlier: Access
    later: Access

    def describe(self) -> str:
        lo, hi = max(self.earlier.lo, self.later.lo), min(self.earlier.hi, self.later.hi)
        return (f"bytes [{lo}, {hi}) of the allocation at {self.storage:#x}: {self.later.describe()} is not "
                f"ordered after the {self.earlier.describe()}")


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


@dataclass
class HappensBefore:
    """The bookkeeping, independent of torch (unit-tested with synthetic events)."""

    clocks: dict[int, dict[int, int]] = field(default_factory=dict)
    host: dict[int, int] = field(default_factory=dict)
    events: dict[int, dict[int, int]] = field(default_factory=dict)
    accesses: dict[int, list[Access]] = field(default_factory=dict)
    races: list[Race] = field(default_factory=list)
    race_count: int = 0
    launches: int = 0

    def _clock(self, stream: int) -> dict[int, int]:
        vc = self.clocks.get(stream)
        if vc is None:
            vc = self.clocks[stream] = {stream: 0}
        return vc

    # ---- trace events ---------------------------------------------------------------
    def event_record(self, event: int, stream: int) -> None:
        vc = self._clock(stream)
        _merge(vc, self.host)
        self.events[event] = dict(vc)

    def event_wait(self, event: int, stream: int) -> None:
        _merge(self._clock(stream), self.events.get(event, {}))

    def event_synchronize(self, event: int) -> None:
        _merge(self.host, self.events.get(event, {}))

    def stream_synchronize(self, stream: int) -> None:
        _merge(self.host, self._clock(stream))

    def device_synchronize(self) -> None:
        for vc in self.clocks.values():
            _merge(self.host, vc)

    def event_deleted(self, event: int) -> None:
        self.events.pop(event, None)

    def freed(self, storage: int) -> None:
        self.accesses.pop(storage, None)

    # ---- kernels ----------------------------------------------------------------------
    def launch(self, stream: int, reads, writes, op: str, where: str) -> None:
        """``reads`` / ``writes``: (storage, lo, hi) byte ranges touched by one kernel on ``stream``."""
        vc = self._clock(stream)
        _merge(vc, self.host)
        vc[stream] += 1
        self.launches += 1
        seq = vc[stream]
        for kind, ranges in (("read", reads), ("write", writes)):
            for storage, lo, hi in ranges:
                self._access(storage, Access(kind, lo, hi, stream, seq, op, where), vc)

    def _access(self, storage: int, new: Access, vc: dict[int, int]) -> None:
        records = self.accesses.setdefault(storage, [])
        keep = []
        for old in records:
            overlaps = old.lo < new.hi and new.lo < old.hi
            ordered = vc.get(old.stream, 0) >= old.seq
            if overlaps and not ordered and "write" in (old.kind, new.kind):
                self.race_count += 1
                if len(self.races) < MAX_REPORTED:
                    self.races.append(Race(storage, old, new))
            # An older access inside the new one's range and ordered before it can go: any later
            # access that would conflict with it conflicts with the new one too (unless the old
            # one is a write and the new one only a read).
            covered = ordered and new.lo <= old.lo and old.hi <= new.hi
            if covered and (new.kind == "write" or old.kind == "read"):
                continue
            keep.append(old)
        keep.append(new)
        self.accesses[storage] = keep


class RaceDetector(HappensBefore):
    """Listens to one device type's trace hooks and torch operators while ``watching()``."""

    _active: Optional["RaceDetector"] = None
    _hooked: set[str] = set()

    def __init__(self, trace: "devices.StreamTrace"):
        super().__init__()
        self.trace = trace

    @classmethod
    def for_device(cls, device: str) -> Optional["RaceDetector"]:
        trace = devices.stream_trace(device)
        return None if trace is None else cls(trace)

    @classmethod
    def _hook(cls, trace: "devices.StreamTrace") -> None:
        """Register forwarding callbacks once per device type (torch has no way to remove them)."""
        if trace.device_type in cls._hooked:
            return
        trace.activate()

        def forward(method):
            def callback(*args):
                active = cls._active
                if active is not None and active.trace.device_type == trace.device_type:
                    getattr(active, method)(*args)
            return callback

        m = trace.module
        m.register_callback_for_event_record(forward("event_record"))
        m.register_callback_for_event_wait(forward("event_wait"))
        m.register_callback_for_event_synchronization(forward("event_synchronize"))
        m.register_callback_for_stream_synchronization(forward("stream_synchronize"))
        m.register_callback_for_device_synchronization(forward("device_synchronize"))
        m.register_callback_for_event_deletion(forward("event_deleted"))
        m.register_callback_for_memory_deallocation(forward("freed"))
        cls._hooked.add(trace.device_type)

    @contextlib.contextmanager
    def watching(self) -> Iterator["RaceDetector"]:
        if RaceDetector._active is not None:
            raise RuntimeError("a race detector is already watching")
        self._hook(self.trace)
        mode = _dispatch_mode(self)
        RaceDetector._active = self
        try:
            with mode:
                yield self
        finally:
            RaceDetector._active = None

    def describe(self) -> str:
        if not self.race_count:
            return f"no unsynchronised access in {self.launches} kernel launches"
        lines = [f"{self.race_count} unsynchronised access(es) in {self.launches} kernel launches"
                 f"{f' (first {len(self.races)})' if self.race_count > len(self.races) else ''}:"]
        lines += [f"  - {r.describe()}" for r in self.races]
        return "\n".join(lines)


# ---- torch side ----------------------------------------------------------------------

_SELF = os.path.abspath(__file__)
_TORCH_DIR = f"{os.sep}torch{os.sep}"


def _caller() -> str:
    """The innermost frame outside torch and this module: where the kernel was asked for."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if _TORCH_DIR not in name and name != _SELF:
            cwd = os.getcwd()
            return f"{os.path.relpath(name) if name.startswith(cwd) else name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _byte_range(t) -> Optional[tuple[int, int, int]]:
    if t.numel() == 0:
        return None
    size = t.element_size()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), lo, lo + extent * size


def _dispatch_mode(detector: RaceDetector):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    skip_ops = {torch.ops.aten.record_stream.default}
    dev_type = detector.trace.device_type

    def tensors(value):
        return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.device.type == dev_type]

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func in skip_ops or detector.trace.capturing():
                return out
            schema = func._schema
            reads, writes = [], []
            by_name = {a.name: a for a in schema.arguments}
            pairs = list(zip(schema.arguments, args)) + [(by_name[k], v) for k, v in kwargs.items() if k in by_name]
            for arg, value in pairs:
                alias = arg.alias_info
                if alias is not None and not alias.is_write:
                    continue  # a view: no data touched
                for t in tensors(value):
                    r = _byte_range(t)
                    if r is not None:
                        (writes if alias is not None and alias.is_write else reads).append(r)
            for ret, value in zip(schema.returns, out if isinstance(out, tuple) else (out,)):
                if ret.alias_info is not None:
                    continue  # a view, or an in-place / out= return: an argument already counted
                for t in tensors(value):
                    r = _byte_range(t)
                    if r is not None:
                        writes.append(r)
            if reads or writes:
                written = set(writes)
                detector.launch(detector.trace.stream_id(), [r for r in reads if r not in written], writes,
                                schema.name, _caller())
            return out

    return _Mode()
