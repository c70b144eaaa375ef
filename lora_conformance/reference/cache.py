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
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional




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

    def get(self, key: str) -> Optional[dict]:
        if self.refresh:
            return None
        p = self._path(key)
        try:
            with open(p) as f:
                value = json.load(f)
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return None  # a corrupt entry is recomputed, never trusted
        self.hits += 1
        return value

    def put(self, key: str, value: dict) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        from filelock import FileLock

        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(p) + ".lock", timeout=600):
            yield
