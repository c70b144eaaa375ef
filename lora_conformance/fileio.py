"""Writes that concurrent readers never see half-done (a JSON file, a text file, a whole
directory), the leftovers of killed writers removed, and the environment's own failures
(read-only, full) told apart from the data's.

pytest-xdist workers share one cache (models, adapters, references, module shapes, durations), so
every writer goes through a temp file or directory beside the target and one ``os.replace``: a
reader sees the old content or the whole new one. Stdlib only at import time (``filelock`` is
imported where a directory is built), so any layer may call it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


TEMP_PREFIX = ".tmp-"
# A temp file older than this is a dead writer's (a write takes milliseconds).
STALE_TEMP_S = 600.0
# What a cache write fails with when the environment, not the data, is at fault.
ENVIRONMENT_ERRNOS = frozenset(e for e in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC,
                                           getattr(errno, "EDQUOT", None), errno.ENOENT, errno.ENOTDIR)
                               if e is not None)


class CacheEnvironmentError(RuntimeError):
    """The cache cannot be written (read-only file system, disk full, permissions): the run's
    environment is at fault, not the engine under test."""


CACHE_HINT = ("a run writes references, adapters and timings there: give a writable --lora-cache "
              "(e.g. a copy of this one)")


def environment_error(path: Path, exc: OSError, what: str = "the lora-conformance cache",
                      hint: str = CACHE_HINT) -> CacheEnvironmentError:
    reason = exc.strerror or type(exc).__name__
    return CacheEnvironmentError(f"cannot write {what} at {path}: {reason} (errno {exc.errno}); {hint}")


def check_writable_dir(path: Path, what: str, hint: str = CACHE_HINT) -> None:
    """Create ``path`` if needed and write (then remove) a probe file in it; raise
    CacheEnvironmentError naming ``what`` when that fails. Run before any work, so a read-only
    cache or report directory stops the run at once instead of after it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=TEMP_PREFIX + "probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise environment_error(path, exc, what, hint) from None


def remove_stale_temps(directory: Path, prefix: str = TEMP_PREFIX, max_age_s: float = STALE_TEMP_S) -> int:
    """Remove files and directories named ``prefix*`` in ``directory`` older than ``max_age_s``
    (a killed writer's leftovers); returns how many. Never raises."""
    removed, now = 0, time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(prefix) or entry.name.endswith(".lock"):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < max_age_s:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except OSError:
            pass  # another process removed it, or it is not ours to remove
    return removed


def write_json_atomic(path: Path, value: Any, **dump_args) -> None:
    """Write ``value`` as JSON to ``path`` through a temp file and a rename: a concurrent reader
    (another pytest-xdist worker) sees the old file or the whole new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, **dump_args)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    remove_stale_temps(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)`` through a temp file and a rename (readers never see half of it)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_directory_once(final: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """``final``, built by ``build(tmp)`` into a temp directory beside it and renamed into place,
    unless ``complete(final)`` already holds. A file lock per target makes racing processes build
    it once; the loser of the race finds it complete. An incomplete ``final`` (a crash of an older
    layout) is replaced."""
    from filelock import FileLock

    final = Path(final)
    if complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if complete(final):  # another process won the race
            return final
        remove_stale_temps(final.parent, f".{final.name}.", max_age_s=0)  # under the lock: a killed build's
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: readers see nothing or the whole directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# A stored report is compressed JSON (``report.json.xz``, or ``.gz``); a run writes plain JSON.
REPORT_SUFFIXES = ("", ".xz", ".gz")


def report_file(path: Path) -> Path:
    """The report file a path names: itself, or a directory's ``report.json`` (``report.json.xz`` or
    ``.gz`` where only a compressed one is there)."""
    path = Path(path)
    if path.is_dir():
        found = [path / f"report.json{s}" for s in REPORT_SUFFIXES if (path / f"report.json{s}").exists()]
        return found[0] if found else path / "report.json"
    return path


def read_report_bytes(path: Path) -> tuple[Path, bytes]:
    """(the file read, its JSON bytes) of a report as written (JSON) or as stored (``.xz``, ``.gz``).
    OSError and the decompressors' errors propagate as OSError/ValueError for the caller to name the file."""
    import gzip
    import lzma

    path = report_file(path)
    data = path.read_bytes()
    if path.suffix == ".xz":
        try:
            return path, lzma.decompress(data)
        except lzma.LZMAError as exc:
            raise ValueError(f"not xz-compressed JSON ({exc})") from None
    return path, (gzip.decompress(data) if path.suffix == ".gz" else data)


def store_report(report_json: Path, target: Path) -> Path:
    """Keep a report in a repository: its JSON re-written compactly and xz-compressed at ``target``
    (``.json.xz``). The digest and signature cover canonical forms, so both still verify."""
    import lzma

    _, data = read_report_bytes(report_json)
    compact = json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    target = Path(target)
    target.write_bytes(lzma.compress(compact, preset=9 | lzma.PRESET_EXTREME))
    return target


def once_per_run(run_dir: Path, key: str, compute: Callable[[], Any], wait_s: float) -> Any:
    """``compute()``'s JSON-able answer, computed once among the processes that share ``run_dir``
    (pytest-xdist's recipe: the first to take the lock file computes and writes the answer, the others
    read it). A waiter computes for itself when the owner died, gave up (lock gone) or took longer
    than ``wait_s``; an interrupted owner removes its lock, so no waiter waits for nothing."""
    import hashlib

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stem = hashlib.sha256(key.encode()).hexdigest()[:24]
    answer, lock = run_dir / f"{stem}.json", run_dir / f"{stem}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while not answer.exists():
            try:
                owner = int(lock.read_text() or 0)
                if owner:
                    os.kill(owner, 0)  # the process computing it is still there
            except (OSError, ValueError):  # the lock is gone (given up) or its owner died
                if not answer.exists():
                    return compute()
            if time.monotonic() > deadline:
                return compute()
            time.sleep(0.2)
        return json.loads(answer.read_text())["answer"]
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        result = compute()
    except BaseException:
        lock.unlink(missing_ok=True)  # interrupted: a waiting process asks for itself
        raise
    write_json_atomic(answer, {"answer": result})
    return result


def read_report_object(path: Path, error: type) -> tuple[Path, dict]:
    """(the file read, the report's JSON object); anything unreadable raises ``error`` naming the file."""
    path = report_file(path)
    try:
        data = json.loads(read_report_bytes(path)[1].decode("utf-8"))
    except (OSError, EOFError, ValueError) as exc:  # UnicodeDecodeError and lzma's errors are ValueErrors here
        raise error(f"{path}: cannot read a report: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a report is a JSON object, got {type(data).__name__}")
    return path, data
