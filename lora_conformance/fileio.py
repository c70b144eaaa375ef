"""Writes that concurrent readers never see half-done: a JSON file, or a whole directory.

pytest-xdist workers share one cache (models, adapters, references, module shapes, durations), so
every writer goes through a temp file or directory beside the target and one ``os.replace``: a
reader sees the old content or the whole new one. Stdlib only at import time (``filelock`` is
imported where a directory is built), so any layer may call it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def write_json_atomic(path: Path, value: Any, **dump_args) -> None:
    """Write ``value`` as JSON to ``path`` through a temp file and a rename: a concurrent reader
    (another pytest-xdist worker) sees the old file or the whole new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, **dump_args)
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
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: readers see nothing or the whole directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
