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

from lora_conformance.fileio import (  # noqa: F401  (re-exported: the cache's writers)
    CACHE_HINT,
    ENVIRONMENT_ERRNOS,
    STALE_TEMP_S,
    TEMP_PREFIX,
    CacheEnvironmentError,
    check_writable_dir,
    environment_error,
    remove_stale_temps,
    write_json_atomic,
    write_text_atomic,
)


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
