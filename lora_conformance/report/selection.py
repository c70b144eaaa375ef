"""What a run selected, and whether it ran the whole suite.

A certification is a claim about every feature the suite declares. A run narrowed by ``-k``,
``-m``, ``--lf``, ``--deselect``, explicit node ids or files, or a CI shard shows less: its
report is *partial*, never certified. The report records the selection (``describe``):

- the pytest arguments and selection options as given (``args``, ``paths``: the files, directories
  and node ids collected from, relative to the rootdir, ``keyword``, ``markexpr``,
  ``last_failed``, ``failed_first``, ``deselect``, ``ignore``, ``stepwise``, ``maxfail``), and
  whether the run was ``interrupted`` (pytest's exit status 2);
- ``deselected``: each collected case that was left out, with its feature id;
- ``declared_features``: the feature vocabulary of the suite files (their ``feature`` markers,
  read from the source, so a file that was not collected still counts);
- ``suite``: a sha256 of each suite file and one over all of them, and the package version:
  two reports are of the same suite exactly when these agree.

What the selection means for the verdict (coverage: the features that ran every one of their
collected cases, out of every feature the suite declares or the run saw) is the judge's
(``lora_conformance.judge.verdict.coverage``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from lora_conformance import features

_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist"}


def _test_files(directory: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
        out += [Path(root) / f for f in sorted(files)
                if (f.startswith("test_") and f.endswith(".py")) or f == "conftest.py"]
    return out


def suite_directories(args: Iterable[str], invocation_dir: Path, rootpath: Path,
                      nodeids: Iterable[str]) -> list[Path]:
    """Where the run's suite files live: each path argument's directory (a file's parent), and the
    directory of each recorded test file; nested ones fold into the outermost."""
    dirs: set[Path] = set()
    for arg in args:
        path = (invocation_dir / str(arg).split("::", 1)[0]).resolve()
        if path.is_dir():
            dirs.add(path)
        elif path.is_file():
            dirs.add(path.parent)
    for nodeid in nodeids:
        path = (rootpath / nodeid.split("::", 1)[0]).resolve()
        if path.is_file():
            dirs.add(path.parent)
    return sorted(d for d in dirs if not any(o != d and o in d.parents for o in dirs))


def suite_facts(directories: Iterable[Path]) -> tuple[dict[str, Any], list[str]]:
    """(``{"files": {name: sha256}, "sha256": digest over them, "version"}``, declared feature ids)."""
    import lora_conformance

    files: dict[str, str] = {}
    declared: list[str] = []
    for directory in directories:
        for path in _test_files(directory):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            name = f"{directory.name}/{path.relative_to(directory).as_posix()}"
            files[name] = hashlib.sha256(data).hexdigest()
            if path.name != "conftest.py":
                declared += features.declared_in_source(data.decode("utf-8", "replace"))
    overall = hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in sorted(files.items())).encode()).hexdigest()
    return {"files": dict(sorted(files.items())), "sha256": overall, "version": lora_conformance.__version__}, \
        sorted(set(declared))


def describe(config: Any, deselected: Mapping[str, str], nodeids: Iterable[str],
             exitstatus: Optional[int] = None, crashed_workers: int = 0,
             not_reached: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The selection of a finished run (``config``: its pytest config, on the controller;
    ``exitstatus``: pytest's, where 2 means the run was interrupted; ``crashed_workers``: the
    pytest-xdist workers that died during it; ``not_reached``: the selected cases that never ran,
    with their feature ids)."""
    opt = config.option
    invocation = Path(config.invocation_params.dir)
    args = [str(a) for a in config.invocation_params.args]
    suite, declared = suite_facts(suite_directories([str(a) for a in config.args], invocation,
                                                    Path(config.rootpath), nodeids))
    root = Path(config.rootpath)

    def shown(arg: str) -> str:
        path, sep, rest = str(arg).partition("::")
        try:
            path = Path(path).resolve().relative_to(root).as_posix()
        except ValueError:
            pass
        return path + sep + rest

    return {
        "args": args,
        "paths": [shown(a) for a in config.args],
        "keyword": getattr(opt, "keyword", "") or None,
        "markexpr": getattr(opt, "markexpr", "") or None,
        "last_failed": bool(getattr(opt, "lf", False)),
        "failed_first": bool(getattr(opt, "failedfirst", False)),
        "deselect": [str(d) for d in getattr(opt, "deselect", None) or ()],
        "ignore": [str(p) for p in (getattr(opt, "ignore", None) or ()) + (getattr(opt, "ignore_glob", None) or ())],
        "stepwise": bool(getattr(opt, "stepwise", False) or getattr(opt, "stepwise_skip", False)),
        "maxfail": int(getattr(opt, "maxfail", 0) or 0),
        "interrupted": int(exitstatus) == 2 if exitstatus is not None else False,
        "stopped": crash_stop(config, crashed_workers),
        "deselected": dict(sorted(deselected.items())),
        "not_reached": dict(sorted((not_reached or {}).items())),
        "declared_features": declared,
        "suite": suite,
    }


def crash_stop(config: Any, crashed_workers: int) -> Optional[str]:
    """Why a run stopped before its end where pytest-xdist gave up on crashed workers: it replaces
    a crashed worker ``--max-worker-restart`` times (default four per worker), then stops handing
    out tests and ends the run as if it had finished; None where it did not."""
    if not crashed_workers:  # none without pytest-xdist, whose hook counts them
        return None
    from xdist.dsession import get_default_max_worker_restart

    limit = get_default_max_worker_restart(config)
    if limit is None or crashed_workers <= limit:
        return None
    return (f"the run's stop after {crashed_workers} crashed workers (pytest-xdist replaces at most "
            f"{limit}: --max-worker-restart)")


def narrowing(selection: Optional[Mapping[str, Any]]) -> list[str]:
    """The selection options a run was narrowed by, as a reader would type them."""
    if not isinstance(selection, Mapping):
        return []
    out = []
    narrow = [p for p in selection.get("paths") or () if "::" in p or str(p).endswith(".py")]
    if narrow:
        out.append("only " + " ".join(narrow))
    if selection.get("keyword"):
        out.append(f"-k {selection['keyword']!r}")
    if selection.get("markexpr"):
        out.append(f"-m {selection['markexpr']!r}")
    if selection.get("last_failed"):
        out.append("--lf")
    out += [f"--deselect {d}" for d in selection.get("deselect") or ()]
    out += [f"--ignore {d}" for d in selection.get("ignore") or ()]
    if selection.get("stepwise"):
        out.append("--stepwise")
    if selection.get("interrupted"):
        out.append("an interrupt")
    if selection.get("stopped"):
        out.append(str(selection["stopped"]))
    if selection.get("maxfail"):
        out.append(f"--maxfail {selection['maxfail']}")
    if selection.get("deselected"):
        out.append(f"{len(selection['deselected'])} case(s) deselected")
    if selection.get("not_reached"):
        out.append(f"{len(selection['not_reached'])} selected case(s) never reached")
    return out


def merge_selections(selections: Iterable[Optional[Mapping[str, Any]]], where: str = "") -> Optional[dict[str, Any]]:
    """One selection for the shards of one run: their deselected cases and declared features
    united (a case one shard left out and another ran counts as run). None when none recorded one.
    Raises ValueError when the shards ran different suite files."""
    known = [s for s in selections if isinstance(s, Mapping)]
    if not known:
        return None
    digests = {(s.get("suite") or {}).get("sha256") for s in known}
    if len(digests) > 1:
        raise ValueError(f"{where}reports of different suite files (suite digests "
                         f"{', '.join(sorted(str(d)[:12] for d in digests))}) cannot be one column")
    deselected: dict[str, str] = {}
    not_reached: dict[str, str] = {}
    declared: set[str] = set()
    for s in known:
        deselected.update(s.get("deselected") or {})
        not_reached.update(s.get("not_reached") or {})
        declared.update(s.get("declared_features") or ())
    return {"shards": len(known), "deselected": deselected, "not_reached": not_reached,
            "declared_features": sorted(declared), "suite": dict(known[0].get("suite") or {})}
