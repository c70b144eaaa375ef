"""Tensor-parallel ranks as processes (nano-vllm style).

Rank 0 is the engine's own process: it schedules, samples and owns the adapter registry. Ranks
1.. are spawned workers: each builds the same model from the whole checkpoint, keeps its shards
(layers/parallel.py) and runs every model-runner call that rank 0 makes, in the same order, so
the layers' collectives meet. Rank 0 broadcasts each call (``RankZeroRunner``: slot copies,
slot clears, prefill and decode steps; an adapter's packed factors travel with its slot copy,
and each rank cuts its shard) over a gloo control group, whatever the device's collective
backend (``devices.collective_backend``: gloo on cpu, NCCL on CUDA).

The ranks meet through a file store in a fresh temporary directory (no port to collide over).
A worker dies with the engine: ``stop`` asks it to exit and then terminates it, a finalizer
does the same if the engine is never closed, and on Linux the kernel kills it when rank 0's
process dies (``PR_SET_PDEATHSIG``). A worker that fails exits, so rank 0's next collective
fails instead of waiting.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from lora_conformance import devices

# The model-runner calls every rank runs (the others read host state rank 0 owns).
CALLS = ("load_slots", "clear_slot", "prefill", "decode")
STARTUP_TIMEOUT_S = 300.0  # spawning imports torch in each worker: slow on a busy host


class Control:
    """Pickled objects from rank 0 to every rank, over a gloo group of their own."""

    def __init__(self, store, rank: int, size: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        self.rank = rank
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size,
                                           datetime.timedelta(seconds=timeout_s))

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(t, 0).wait()
        return t

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._bcast(torch.tensor([len(data)], dtype=torch.long))
        self._bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv(self):
        n = int(self._bcast(torch.zeros(1, dtype=torch.long)).item())
        return pickle.loads(self._bcast(torch.empty(n, dtype=torch.uint8)).numpy().tobytes())

    def all_ready(self, ok: bool) -> bool:
        """True where every rank is ready (a sum of failures over the control group)."""
        t = torch.tensor([0 if ok else 1], dtype=torch.long)
        self.group.allreduce([t]).wait()
        return int(t.item()) == 0


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the engine's device on cpu; on accelerators the r-th after the engine's."""
    if devices.device_type(device) == "cpu":
        return device
    kind, _, index = device.partition(":")
    return f"{kind}:{int(index or 0) + rank}"


def connect(store_path: str, rank: int, size: int, device: str, timeout_s: float):
    """(this rank's TensorParallel, the control channel)."""
    import torch.distributed as dist

    from lora_conformance.engines.builtin.layers.parallel import TensorParallel

    import datetime

    store = dist.FileStore(store_path, size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    control = Control(store, rank, size, timeout_s)
    tp = TensorParallel(rank, size, dist.PrefixStore("tp", store), devices.collective_backend(device), device)
    return tp, control


class RankZeroRunner:
    """Rank 0's model runner: each call in CALLS is broadcast to the workers, then run here."""

    def __init__(self, runner, control: Control):
        self.__dict__.update(runner=runner, control=control)

    def __getattr__(self, name):
        attr = getattr(self.runner, name)
        if name not in CALLS:
            return attr

        def call(*args):
            self.control.send((name, args))
            return attr(*args)
        return call

    def __setattr__(self, name, value):
        setattr(self.runner, name, value)


class Workers:
    """Ranks 1..size-1 of one engine; ``start`` spawns them, ``stop`` ends them."""

    def __init__(self, size: int):
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="lora-tp-")
        self.store_path = str(Path(self.dir) / "store")
        self.procs: list = []
        self.control: Control | None = None

    def start(self, model_dir: Path, device: str, dtype: str, cfg) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and device state
        for rank in range(1, self.size):
            p = ctx.Process(target=worker_main, name=f"lora-tp-rank{rank}", daemon=True,
                            args=(rank, self.size, self.store_path, str(model_dir), rank_device(device, rank),
                                  dtype, cfg, os.getpid()))
            p.start()
            self.procs.append(p)

    def stop(self) -> None:
        """Ask the workers to exit; terminate, then kill, any that does not."""
        if self.control is not None:
            try:
                self.control.send(None)
            except Exception:  # noqa: BLE001 - a dead worker cannot be told; it is reaped below
                pass
            self.control = None
        stop_processes(self.procs)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_processes(procs, grace_s: float = 20.0) -> None:
    for p in procs:
        p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies (no orphan worker)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above ran
        os._exit(1)


def worker_main(rank: int, size: int, store_path: str, model_dir: str, device: str, dtype: str, cfg,
                parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    try:
        tp, control = connect(store_path, rank, size, device, STARTUP_TIMEOUT_S)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(1)
    runner = None
    try:
        from lora_conformance.engines.builtin.engine.model_runner import build_rank

        runner = build_rank(Path(model_dir), device, dtype, cfg, tp)[-1]
    except BaseException:  # noqa: BLE001 - rank 0 hears of it through all_ready
        traceback.print_exc()
    try:
        if not control.all_ready(runner is not None) or runner is None:
            os._exit(1)
        with torch.inference_mode():
            while True:
                msg = control.recv()
                if msg is None:
                    break
                name, args = msg
                getattr(runner, name)(*args)
    except BaseException:  # noqa: BLE001 - exiting breaks rank 0's pending collective
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
