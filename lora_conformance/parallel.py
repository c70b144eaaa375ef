"""How a run spreads over the machine: pytest-xdist workers, and torch threads per worker.

Two decisions, each a pure function of a few machine facts so that it can be tested:

* ``thread_share``: each worker's torch intra-op threads. Every xdist worker otherwise keeps
  torch's default pool (all cores), so N workers run N x cores busy threads and a parallel run
  is slower than a serial one. The share is ``cores // workers`` (at least 1) unless the user
  chose: ``--lora-threads`` (its env variable or ini key), else ``OMP_NUM_THREADS`` (which torch
  reads itself; we then leave torch alone).
* ``choose_workers``: the worker count of ``-n auto`` in a run with the plugin (``pytest suites -n
  auto`` and ``lora-conformance certify`` alike: the plugin's ``pytest_xdist_auto_num_workers``
  asks ``workers_for_run``): one per core, capped by memory, by the tests the last run recorded
  and, on accelerators, by ``WORKERS_PER_DEVICE`` per device and, where the profile says what one
  worker holds on the device, by the device's memory.

Standard library only: the plugin imports this at start-up. torch is imported by
``apply_thread_share`` alone, which runs just before the first engine or reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

# Resident memory of one worker running the suites on cpu (torch, transformers, PEFT, the
# reference and engine models): about 1.7 GB measured; rounded up.
WORKER_MEMORY_BYTES = 2 * 1024**3
# Workers that share one accelerator. Processes on one device time-slice it; past this the
# device, not the host, is the bottleneck (bench/certify_time.py measures it on a machine).
WORKERS_PER_DEVICE = 8
USER_THREAD_VARIABLE = "OMP_NUM_THREADS"
# Test time a worker should have to be worth starting. Each worker pays about 2 s of start-up
# (python, pytest, torch, collection) and its own first uses (imports, engines, models) before its
# tests; with less work than that, another worker costs more than it saves. On the H200 host's
# 16-core cpu (bench/certify_time.py, warm), about 24 s of recorded tests certified in
# 20.7 s with 2 workers, 16.1 s with 4, 15.6 s with 8 and 18.4 s with 16 (one per core).
MIN_WORK_PER_WORKER_S = 3.0


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset and cgroup cpusets shrink it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def worker_cpus(environ: Mapping[str, str] = os.environ, cpus: Optional[list[int]] = None) -> list[int]:
    """The CPU ids that are this process's share when pytest-xdist spreads a run over the machine:
    worker ``gwK`` of ``N`` gets the K-th of N equal slices of the CPUs it may run on (all of them
    outside xdist; a worker beyond the CPU count shares one). For engines that pin their own
    threads to CPUs (vLLM on cpu), so that two workers' engines do not pin onto the same core."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()) or int(count) <= 1:
        return list(cpus)
    return cpu_slice(list(cpus), int(worker[2:]), int(count))


def cpu_slice(cpus: list[int], k: int, n: int) -> list[int]:
    """The k-th of n equal slices of ``cpus`` (the last takes the remainder); with more slices than
    CPUs, slice k shares CPU k mod len(cpus)."""
    if n >= len(cpus):
        return [cpus[k % len(cpus)]]
    size = len(cpus) // n
    return list(cpus[k * size: len(cpus) if k == n - 1 else (k + 1) * size])


def available_memory() -> Optional[int]:
    """Bytes of memory available for new work (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def release_freed_memory() -> None:
    """Collect cycles now and hand the C allocator's free pages back to the system (glibc's
    ``malloc_trim``; elsewhere the collection alone). A closed real-shape engine frees GBs of tensors
    that glibc keeps for reuse, fragmented among what stays alive: on a 24 GiB cpu host, a process
    that built and closed a built-in and a PEFT engine in turn, every run, grew 5.7 -> 12.4 GB
    anonymous over seven runs (an earlier one, before engines collected on close, was killed at 24.1);
    trimming after each close, 5.7 -> 8.3 GB (bench/power.py's ``resident_gb``)."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


# ---- threads per worker -----------------------------------------------------------------


@dataclass(frozen=True)
class ThreadShare:
    threads: Optional[int]  # what torch.set_num_threads gets; None: leave torch as the user set it
    source: str  # why, for the report header

    def describe(self) -> str:
        shown = "unchanged" if self.threads is None else str(self.threads)
        return f"torch-threads={shown} ({self.source})"


def _positive_or_auto(value: str, what: str = "") -> Optional[int]:
    """A positive integer, or None for ``auto``; the error names ``what`` when given."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    prefix = f"{what} {value!r}: " if what else ""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{prefix}expected a positive integer or auto") from None
    if n < 1:
        raise ValueError(f"{prefix}expected a positive integer or auto")
    return n


def parse_threads(value: str) -> Optional[int]:
    """``--lora-threads``: a positive integer, or ``auto`` (None: the per-worker share)."""
    return _positive_or_auto(value)


def thread_share(cores: int, workers: int, option: Optional[int] = None, option_source: str = "",
                 environ: Mapping[str, str] = os.environ) -> ThreadShare:
    """Torch intra-op threads for one of ``workers`` processes on ``cores`` cores."""
    if option is not None:
        return ThreadShare(option, f"--lora-threads from {option_source or 'command line'}")
    user = environ.get(USER_THREAD_VARIABLE, "").strip()
    if user:
        return ThreadShare(None, f"{USER_THREAD_VARIABLE}={user} set by the user")
    workers = max(1, workers)
    return ThreadShare(max(1, cores // workers), f"{cores} cores // {workers} worker{'s' if workers > 1 else ''}")


def apply_thread_share(share: ThreadShare) -> None:
    """Set torch's intra-op pool to the share (before any engine or reference work)."""
    if share.threads is None:
        return
    import torch

    if torch.get_num_threads() != share.threads:
        torch.set_num_threads(share.threads)


def xdist_worker_index() -> Optional[int]:
    """This process's pytest-xdist worker number (``gwN`` -> N), or None outside a worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def xdist_workers(config) -> int:
    """Processes this pytest run spreads over: 1 without pytest-xdist, else its worker count."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # inside a worker
        return max(1, int(workerinput.get("workercount", 1)))
    if getattr(config.option, "dist", "no") == "no":
        # A run nested in a worker (pytester inside ``pytest -n``) still has only that worker's share.
        nested = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        return max(1, int(nested)) if nested.isdigit() else 1
    count = 0
    for spec in getattr(config.option, "tx", None) or ():
        head, star, _ = str(spec).partition("*")
        count += int(head) if star and head.isdigit() else 1
    return max(1, count)


# ---- worker count for ``-n auto`` ----------------------------------------------------------


@dataclass(frozen=True)
class WorkerChoice:
    workers: int
    reason: str


def workers_for_run(device: str, recorded_work_s: Optional[float], profile: Optional[str] = None) -> WorkerChoice:
    """``-n auto`` for a run on ``device`` (a resolved device string): ``choose_workers`` from this
    machine's cores and memory, the device type and how many of them the workers can spread over
    (one, where the device names an index: ``cuda:1`` pins every worker to it), and what one worker
    of the run's certification profile needs (models/profiles.py)."""
    from lora_conformance.models import profiles

    p = profiles.get(profile)
    kind, count, on_device = _device_layout(device, p)
    return choose_workers(cpu_cores(), available_memory(), kind, count, recorded_work_s,
                          worker_memory=int(((kind == "cpu" and p.cpu_worker_memory_gib) or p.worker_memory_gib) * 1024**3),
                          per_device=p.workers_per_device or WORKERS_PER_DEVICE,
                          device_memory=on_device,
                          device_worker_memory=int(p.device_worker_memory_gib * 1024**3),
                          why=f" ({p.name} profile)" if p.name != "fast" else "")


def _device_layout(device: str, p: Any) -> tuple[str, int, Optional[int]]:
    """The device type, how many devices the workers spread over (one where ``device`` names an
    index) and, where profile ``p`` bounds a worker's device memory, one device's size in bytes."""
    kind, count, on_device = "cpu", 1, None
    if device.split(":", 1)[0] != "cpu":
        from lora_conformance import devices

        kind = devices.device_type(device)
        if kind != "cpu" and ":" not in device:
            count = max(1, devices.device_count(kind))
        if kind != "cpu" and p.device_worker_memory_gib:
            on_device = devices.total_memory(device if ":" in device else f"{kind}:0")
    return kind, count, on_device


def device_fit(devices: int, device_memory: int, device_worker_memory: int) -> int:
    """Workers that ``devices`` accelerators of ``device_memory`` bytes each hold at
    ``device_worker_memory`` a worker (at least one a device)."""
    return max(1, devices) * max(1, int(device_memory // device_worker_memory))


def device_overcommit(device: str, profile: Optional[str], workers: int) -> Optional[str]:
    """Where the run's profile says what one worker holds on the device: a warning when ``workers``
    is more than the devices hold, else None (``-n auto`` never is: it is bounded by the same
    memory; a given ``-n N`` can be). Such a run's
    cases fail with the device's out-of-memory errors, which say nothing of the engine (two
    full-profile workers forced onto one 80 GB card did, cold)."""
    from lora_conformance.models import profiles

    p = profiles.get(profile)
    if workers <= 1 or not p.device_worker_memory_gib:
        return None
    kind, count, on_device = _device_layout(device, p)
    if kind == "cpu" or not on_device:
        return None
    fit = device_fit(count, on_device, int(p.device_worker_memory_gib * 1024**3))
    if workers <= fit:
        return None
    plural = "s" if count != 1 else ""
    return (f"-n {workers}: more workers than fit: the {p.name} profile's worker holds about "
            f"{p.device_worker_memory_gib:g} GiB on the device (models/profiles.py), and {count} {kind} "
            f"device{plural} of {on_device / 1024**3:.0f} GiB hold {fit}; cases may fail with out-of-memory "
            f"errors that say nothing of the engine (-n auto chooses from the device's memory)")


def parse_workers(value: str) -> Optional[int]:
    """``certify -n``: a positive integer, or ``auto`` (None: choose from the machine)."""
    return _positive_or_auto(value, "-n/--workers")


def choose_workers(cores: int, memory: Optional[int], device_type: str = "cpu", devices: int = 1,
                   recorded_work_s: Optional[float] = None, worker_memory: int = WORKER_MEMORY_BYTES,
                   per_device: int = WORKERS_PER_DEVICE, device_memory: Optional[int] = None,
                   device_worker_memory: int = 0, why: str = "") -> WorkerChoice:
    """One worker per core; at most one per ``WORKER_MEMORY_BYTES`` of available memory; on an
    accelerator at most ``WORKERS_PER_DEVICE`` per device (xdist worker gwN uses device N mod
    count, so the workers spread over every device); and, where the last run with these settings
    recorded its test durations (``recorded_work_s``, their sum), at most one per
    ``MIN_WORK_PER_WORKER_S`` of them. A profile with bigger bases gives its own ``worker_memory`` and
    ``per_device``, and what one worker holds on the device (``device_worker_memory``): then at most
    one per that much of each device's memory (``device_memory``, where known) (``why`` names the
    profile in the reason)."""
    limits = [(max(1, cores), f"{cores} cores")]
    if memory is not None:
        limits.append((max(1, memory // worker_memory),
                       f"{memory / 1024**3:.0f} GiB available / {worker_memory / 1024**3:.0f} GiB per worker{why}"))
    if device_type != "cpu":
        plural = "s" if devices != 1 else ""
        limits.append((max(1, devices) * per_device, f"{devices} {device_type} device{plural} x {per_device}{why}"))
        if device_memory and device_worker_memory:
            limits.append((device_fit(devices, device_memory, device_worker_memory),
                           f"{devices} {device_type} device{plural} x {device_memory / 1024**3:.0f} GiB / "
                           f"{device_worker_memory / 1024**3:.0f} GiB per worker on the device{why}"))
    if recorded_work_s:
        limits.append((max(1, int(recorded_work_s // MIN_WORK_PER_WORKER_S)),
                       f"{recorded_work_s:.0f} s of tests in the last run / {MIN_WORK_PER_WORKER_S:g} s per worker"))
    workers, binding = min(limits, key=lambda item: item[0])
    others = ", ".join(text for n, text in limits if text != binding)
    return WorkerChoice(workers, f"auto: {binding}" + (f"; also {others}" if others else ""))
