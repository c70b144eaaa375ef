"""The file order of this project's own test run under pytest-xdist (tests/conftest.py): run_order's
``--dist loadfile`` order, with the measured file times of tests/durations.json for the files the
last run on this machine did not time (a fresh clone, an emptied cache), so the long files start
first there too. docs/performance.md, "The project's own test run"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

SEED_DURATIONS = Path(__file__).with_name("durations.json")


def seed_durations(path: Path = SEED_DURATIONS) -> dict[str, float]:
    """Seconds per test file of a measured run ({} when the file is absent or unreadable)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def item_durations(items: Iterable, recorded: Mapping[str, float], seed: Mapping[str, float]) -> dict[str, float]:
    """Per-test seconds for run_order's file order: the last run's where it timed any test of a
    file, else the file's measured time from ``seed``, given to the file's first test."""
    timed_files = {nodeid.split("::", 1)[0] for nodeid in recorded}
    out = dict(recorded)
    for item in items:
        f = item.nodeid.split("::", 1)[0]
        if f not in timed_files and f in seed:
            out[item.nodeid] = seed[f]
            timed_files.add(f)
    return out
