"""Content-addressed disk cache for reference outputs.

Key = sha256 over everything that determines an output: model and adapter content hashes
(``models.content_hash``, ``adapters.adapter_hash``),
the request, the reference dtype and device type, and library versions. Writes are atomic
(temp file + rename) and guarded by a file lock per key, so pytest-xdist workers that race
on one key compute it once and never read half a file.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from lora_conformance.fileio import write_json_atomic


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class ReferenceCache:
    def __init__(self, root: Path, refresh: bool = False):
        self.root = Path(root)
        self.refresh = refresh
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str, parse: Optional[Callable[[Any], Any]] = None) -> Any:
        """The entry for ``key`` (through ``parse``, which raises on a wrong shape), or None.

        A corrupt entry (not UTF-8, not JSON, or refused by ``parse``) is never trusted: it is
        deleted, with a warning naming the file, and the caller recomputes it."""
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
            value = json.loads(raw.decode("utf-8"))
            if parse is not None:
                value = parse(value)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            self._discard(p, exc)
            return None
        self.hits += 1
        return value

    def _discard(self, path: Path, exc: Exception) -> None:
        import warnings

        warnings.warn(f"reference cache entry {path} is malformed ({type(exc).__name__}: {exc}); "
                      "discarded, it will be recomputed", stacklevel=3)
        try:
            path.unlink()
        except OSError:
            pass

    def put(self, key: str, value: dict) -> None:
        write_json_atomic(self._path(key), value)

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        from filelock import FileLock

        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(p) + ".lock", timeout=600):
            yield
