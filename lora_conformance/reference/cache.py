"""Content-addressed disk cache for reference outputs.

Key = sha256 over everything that determines an output: model and adapter content hashes
(``models.content_hash``, ``adapters.adapter_hash``),
the request, the reference dtype and device type, and library versions. Writes are atomic
(temp file + rename) and guarded by a file lock per key, so pytest-xdist workers that race
on one key compute it once and never read half a file.

Each entry carries the sha256 of its value (canonical JSON) and is checked on every read: an entry
whose value no longer matches (a flipped digit, an edit, a half-copied cache) is discarded with a
warning naming the file and recomputed, never used. A cache that cannot be written (read-only,
disk full, no permission) is ``CacheEnvironmentError``: an error of the run, not of the engine
under test. A process killed between writing a temp file and renaming it leaves the temp file;
the next write into that directory removes temp files older than ``STALE_TEMP_S``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

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
    import shutil

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


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def value_digest(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (what an entry's ``sha256`` field holds)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"),
                                     allow_nan=True).encode()).hexdigest()


class _DigestMismatch(ValueError):
    pass


class ReferenceCache:
    def __init__(self, root: Path, refresh: bool = False):
        self.root = Path(root)
        self.refresh = refresh
        self.hits = 0
        self.misses = 0
        self.discarded = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str, parse: Optional[Callable[[Any], Any]] = None) -> Any:
        """The entry for ``key`` (through ``parse``, which raises on a wrong shape), or None.

        A corrupt entry (not UTF-8, not JSON, a value that does not match its sha256, or refused
        by ``parse``) is never trusted: it is deleted, with a warning naming the file, and the
        caller recomputes it. An entry without a digest (written before entries carried one)
        is a miss: it is recomputed and rewritten."""
        if self.refresh:
            return None
        p = self._path(key)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._discard(p, exc)
            return None
        try:
            entry = json.loads(raw.decode("utf-8"))
            if not (isinstance(entry, dict) and set(entry) == {"sha256", "value"}):
                if parse is not None:
                    parse(entry)  # not even an older entry's shape: malformed (below)
                return None  # an older entry, without a digest: recomputed and rewritten
            value = entry["value"]
            if value_digest(value) != entry["sha256"]:
                raise _DigestMismatch(f"its value does not match its sha256 {str(entry['sha256'])[:16]}...")
            if parse is not None:
                value = parse(value)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            self._discard(p, exc)
            return None
        self.hits += 1
        return value

    def _discard(self, path: Path, exc: Exception) -> None:
        import warnings

        self.discarded += 1
        what = "corrupt" if isinstance(exc, _DigestMismatch) else "malformed"
        warnings.warn(f"reference cache entry {path} is {what} ({type(exc).__name__}: {exc}); "
                      "discarded, it will be recomputed", stacklevel=3)
        try:
            path.unlink()
        except OSError:
            pass

    def put(self, key: str, value: dict) -> None:
        p = self._path(key)
        value = json.loads(json.dumps(value))  # as a reader will see it (int dict keys become strings)
        try:
            write_json_atomic(p, {"sha256": value_digest(value), "value": value})
        except OSError as exc:
            if exc.errno in ENVIRONMENT_ERRNOS:
                raise environment_error(self.root, exc, "the reference cache") from exc
            raise

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        from filelock import FileLock

        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise environment_error(self.root, exc, "the reference cache") from exc
        try:
            lock = FileLock(str(p) + ".lock", timeout=600)
            lock.acquire()
        except OSError as exc:
            raise environment_error(self.root, exc, "the reference cache") from exc
        try:
            yield
        finally:
            lock.release()
