"""Processes a run starts, and stopping them with nothing left behind.

A server an engine starts (``vllm serve``, SGLang, llama-server) and the pytest run that
``lora-conformance certify`` launches each lead a process group of their own; these helpers
stop a group (SIGTERM, then SIGKILL), and on Linux let the launcher become the subreaper of its
descendants, so that a process whose parent was killed can still be found and stopped.
Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

KILL_GRACE_S = 5.0  # stop_leftovers: between SIGTERM and SIGKILL
SERVER_STOP_S = 30.0  # stop_process_group: a server's time to stop on SIGTERM


def stop_process_group(proc: Optional[subprocess.Popen]) -> None:
    """SIGTERM to the process group ``proc`` leads (a server started with ``start_new_session``: the
    server and every process it spawned), SIGKILL after ``SERVER_STOP_S``; nothing when it has exited already."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=SERVER_STOP_S)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to this process (not to init), so the ones a
    killed worker leaves (a server it started) can still be found and stopped. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        PR_SET_CHILD_SUBREAPER = 36
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc; [] elsewhere)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != b"Z":
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        for child in _children_of(todo.pop()):
            if child not in seen:
                seen.append(child)
                todo.append(child)
    return seen


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_leftovers(pgid: int) -> list[int]:
    """Terminate what the run left: its process group, then every descendant of certify (SIGTERM,
    then SIGKILL after KILL_GRACE_S). Returns the pids that had to be stopped."""
    stopped = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_group(pgid, sig)
        left = descendants(os.getpid())
        for pid in left:
            try:
                os.kill(pid, sig)
                if pid not in stopped:
                    stopped.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (KILL_GRACE_S if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline:
            reap_zombies()
            if not descendants(os.getpid()):
                return stopped
            time.sleep(0.05)
    reap_zombies()
    return stopped
