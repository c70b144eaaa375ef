"""Split suite files into shards of about equal run time.

Longest-processing-time-first: files sorted by time (longest first, ties by path) go one
by one to the shard with the least time so far (ties: lowest shard index). The result is a
pure function of (files, times, n), so the matrix job and every test shard compute the
same split independently. Measured durations, when given, override the registered
estimates.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional

# A durations file kept beside the suites is read by both the matrix job and the shards;
# an explicit file (``--durations`` / LORA_CONFORMANCE_CI_DURATIONS) replaces it.
DEFAULT_DURATIONS_NAME = "ci_durations.json"
DURATIONS_ENV = "LORA_CONFORMANCE_CI_DURATIONS"


def parse_partition(value: str) -> tuple[int, int]:
    """``"i/n"`` (0-based) -> (i, n); ValueError with the accepted form otherwise."""
    text = str(value).strip()
    head, sep, tail = text.partition("/")
    try:
        if not sep:
            raise ValueError
        index, count = int(head), int(tail)
    except ValueError:
        raise ValueError(f"expected i/n with 0 <= i < n (e.g. 0/4), got {value!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"expected i/n with 0 <= i < n (e.g. 0/4), got {value!r}")
    return index, count


@dataclass(frozen=True)
class Shard:
    index: int
    files: tuple[str, ...]
    est_time: float


def lpt(times: Mapping[str, float], n: int) -> list[Shard]:
    """Assign keys (file paths) to ``n`` shards, longest first; deterministic."""
    if n < 1:
        raise ValueError("the number of shards must be >= 1")
    loads = [0.0] * n
    members: list[list[str]] = [[] for _ in range(n)]
    for key in sorted(times, key=lambda k: (-float(times[k]), k)):
        target = min(range(n), key=lambda i: (loads[i], i))
        loads[target] += float(times[key])
        members[target].append(key)
    return [Shard(i, tuple(sorted(members[i])), round(loads[i], 3)) for i in range(n)]


# ---- measured durations -------------------------------------------------------------


def _file_of_nodeid(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _from_junit(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("file")
        if not name:
            # pytest's default junit_family has no file attribute: classname is the dotted
            # module path, plus a class name when the test is a method.
            parts = (case.get("classname") or "").split(".")
            while parts and parts[-1][:1].isupper():
                parts.pop()
            if not parts:
                continue
            name = "/".join(parts) + ".py"
        out[name] = out.get(name, 0.0) + float(case.get("time") or 0.0)
    return out


def _from_json(data) -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(data, dict) and "records" in data:  # a report.json
        for rec in data["records"]:
            f = _file_of_nodeid(rec.get("nodeid", ""))
            out[f] = out.get(f, 0.0) + float(rec.get("duration") or 0.0)
        return out
    if isinstance(data, dict):  # {"suites/test_x.py": seconds}
        return {str(k): float(v) for k, v in data.items()}
    raise ValueError("expected a report.json or a mapping of file path to seconds")


def load_durations(path: Path) -> dict[str, float]:
    """Seconds per file from a JUnit XML, a report.json, or a {file: seconds} JSON."""
    path = Path(path)
    if path.suffix.lower() == ".xml":
        return _from_junit(path)
    return _from_json(json.loads(path.read_text(encoding="utf-8")))


def durations_path(explicit: Optional[str], suites_root: Optional[Path]) -> Optional[Path]:
    """The durations file in force: explicit, else the environment, else beside the suites."""
    chosen = explicit or os.environ.get(DURATIONS_ENV)
    if chosen:
        return Path(chosen)
    if suites_root is not None:
        candidate = Path(suites_root) / DEFAULT_DURATIONS_NAME
        if candidate.is_file():
            return candidate
    return None


def measured(durations: Mapping[str, float], path: Path) -> Optional[float]:
    """The measured time of ``path``: keys are matched as path suffixes (they are relative
    to whatever directory the measuring run started in); the longest match wins."""
    parts = Path(path).resolve().parts
    best: Optional[tuple[int, float]] = None
    for key, seconds in durations.items():
        kparts = PurePosixPath(key.replace("\\", "/")).parts
        if kparts and tuple(parts[-len(kparts):]) == kparts:
            if best is None or len(kparts) > best[0]:
                best = (len(kparts), float(seconds))
    return None if best is None else best[1]


def file_times(estimates: Mapping[Path, float], durations: Optional[Mapping[str, float]]) -> dict[Path, float]:
    out = {}
    for path, est in estimates.items():
        got = measured(durations, path) if durations else None
        out[path] = est if got is None else got
    return out


def split(estimates: Mapping[Path, float], n: int, durations: Optional[Mapping[str, float]] = None,
          root: Optional[Path] = None) -> list[tuple[Shard, list[Path]]]:
    """Shards over real paths. Keys for tie-breaking are paths relative to ``root`` (or the
    common parent), so machines with different checkouts agree."""
    times = file_times(estimates, durations)
    paths = sorted(times)
    if not paths:
        return [(Shard(i, (), 0.0), []) for i in range(n)]
    base = Path(root) if root is not None else Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
    keyed = {}
    for p in paths:
        try:
            key = p.resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            key = p.resolve().as_posix()
        keyed[key] = p
    shards = lpt({k: times[p] for k, p in keyed.items()}, n)
    return [(s, [keyed[k] for k in s.files]) for s in shards]


def effective_shards(requested: int, n_files: int) -> int:
    """No empty shards: an empty one would end in pytest's 'no tests collected'."""
    return max(1, min(requested, n_files))

