"""Which adapters are known, which are resident on the host, and which sit in device slots.

Pure bookkeeping (no device tensors): the model runner performs the copies this pool asks
for. Three tiers: every *registered* name (unbounded, with its path) -> a host cache of
parsed weights bounded by ``max_loaded_loras`` (evicted entries are re-read from disk on
next use) -> ``max_loras_per_batch`` device slots. Both bounded tiers evict by ``lru`` or
``fifo`` and never evict a pinned adapter.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from lora_conformance.engines.base import AdapterNotLoadedError, CapacityError
from lora_conformance.engines.builtin.engine.adapter import HostAdapter


@dataclass
class Registered:
    name: str
    path: Path
    pinned: bool
    version: int
    identity: str


@dataclass
class Slot:
    name: Optional[str] = None
    version: int = -1
    loaded_at: int = 0  # for fifo
    used_at: int = 0  # for lru
    fresh: bool = False  # contents must be (re)copied before use


class AdapterPool:
    def __init__(self, num_slots: int, max_loaded: int, policy: str,
                 read: Callable[[str, Path, bool], HostAdapter], reload_reads_weights: bool = True,
                 evict_pinned: bool = False, unload_frees_path: bool = False):
        self.num_slots, self.max_loaded, self.policy = num_slots, max_loaded, policy
        # False / True only under the faults stale_reload / evict_pinned / unload_frees_same_directory (engine/plan.py)
        self.reload_reads_weights, self.evict_pinned = reload_reads_weights, evict_pinned
        self.unload_frees_path = unload_frees_path
        self._read = read  # (name, path, pinned) -> HostAdapter; validates
        self.registry: dict[str, Registered] = {}
        self.host: "OrderedDict[str, HostAdapter]" = OrderedDict()
        self._host_loaded_at: dict[str, int] = {}
        self.slots = [Slot() for _ in range(num_slots)]
        self._clock = itertools.count(1)
        self._versions = itertools.count(1)

    # ---- registration ----------------------------------------------------------------
    def register(self, name: str, path: Path, pinned: bool) -> None:
        old = self.registry.get(name)
        if pinned and not (old and old.pinned):
            pinned_now = sum(1 for r in self.registry.values() if r.pinned)
            # One slot must stay usable by unpinned adapters, or their requests could never run.
            if pinned_now + 1 > self.num_slots - 1:
                raise CapacityError(
                    f"pinning {name!r} would leave no device slot for unpinned adapters "
                    f"({pinned_now} pinned, max_loras_per_batch={self.num_slots})"
                )
            if pinned_now + 1 > self.max_loaded - 1:
                raise CapacityError(f"pinning {name!r} would fill the host cache (max_loaded_loras={self.max_loaded})")
        if old is not None and not self.reload_reads_weights:
            old.pinned = old.pinned or pinned
            return  # the bug: the new weights are never read
        adapter = self._read(name, Path(path), pinned)
        version = next(self._versions)
        self.registry[name] = Registered(name, Path(path), pinned, version, adapter.identity)
        self._put_host(name, adapter)
        for s in self.slots:  # a reloaded name's slot holds stale weights now
            if s.name == name:
                s.version = -1

    def unregister(self, name: str) -> list[int]:
        """Forget ``name``; returns the device slots it held, which the runner must clear (the
        masked decode reads every slot, so stale weights there can still reach other rows)."""
        if name not in self.registry:
            raise AdapterNotLoadedError(name, list(self.registry))
        path = self.registry.pop(name).path
        self.host.pop(name, None)
        freed = []
        for i, s in enumerate(self.slots):
            if s.name == name:
                s.name, s.version = None, -1
                freed.append(i)
            elif self.unload_frees_path and s.name in self.registry and self.registry[s.name].path == path:
                freed.append(i)  # the fault: cleared, though its name still holds it
        return freed

    def names(self) -> list[str]:
        return list(self.registry)

    def check(self, name: str) -> Registered:
        reg = self.registry.get(name)
        if reg is None:
            raise AdapterNotLoadedError(name, list(self.registry))
        return reg

    # ---- host cache ------------------------------------------------------------------
    def _evictable(self, name: str) -> bool:
        reg = self.registry.get(name)
        return reg is None or not reg.pinned or self.evict_pinned

    def _put_host(self, name: str, adapter: HostAdapter) -> None:
        self.host[name] = adapter
        self.host.move_to_end(name)
        self._host_loaded_at[name] = next(self._clock)
        while len(self.host) > self.max_loaded:
            order = list(self.host) if self.policy == "lru" else sorted(self.host, key=self._host_loaded_at.get)
            victim = next((n for n in order if n != name and self._evictable(n)), None)
            if victim is None:
                break
            del self.host[victim]

    def host_adapter(self, name: str) -> HostAdapter:
        reg = self.check(name)
        ad = self.host.get(name)
        if ad is None:  # evicted from the host cache earlier: read it again
            ad = self._read(name, reg.path, reg.pinned)
            self._put_host(name, ad)
        else:
            self.host.move_to_end(name)  # LRU order = OrderedDict order
        return ad

    # ---- device slots ----------------------------------------------------------------
    def slot_of(self, name: str) -> Optional[int]:
        for i, s in enumerate(self.slots):
            if s.name == name:
                return i
        return None

    def _victim(self, locked: set[str]) -> Optional[int]:
        free = [i for i, s in enumerate(self.slots) if s.name is None]
        if free:
            return free[0]
        cands = [i for i, s in enumerate(self.slots) if s.name not in locked and self._evictable(s.name)]
        if not cands:
            return None
        key = (lambda i: self.slots[i].used_at) if self.policy == "lru" else (lambda i: self.slots[i].loaded_at)
        return min(cands, key=key)

    def can_assign(self, name: str, locked: set[str]) -> bool:
        return self.slot_of(name) is not None or self._victim(locked) is not None

    def assign(self, name: str, locked: set[str]) -> int:
        """A slot for ``name`` (which must not be evicted by later assigns of this batch: put it in locked)."""
        reg = self.check(name)
        i = self.slot_of(name)
        if i is None:
            i = self._victim(locked)
            if i is None:
                raise CapacityError(f"no device slot free for adapter {name!r}")
            self.slots[i] = Slot(name=name, version=-1, loaded_at=next(self._clock))
        s = self.slots[i]
        s.used_at = next(self._clock)
        if s.version != reg.version:
            s.version, s.fresh = reg.version, True
        return i

    def pending_copies(self) -> list[tuple[int, HostAdapter]]:
        """Slots whose contents must be copied before the next forward (clears the flags)."""
        out = []
        for i, s in enumerate(self.slots):
            if s.fresh and s.name is not None:
                out.append((i, self.host_adapter(s.name)))
                s.fresh = False
        return out

    def slot_identities(self) -> list[Optional[str]]:
        return [self.registry[s.name].identity if s.name in self.registry else None for s in self.slots]
