"""``lora-conformance ci list`` and ``lora-conformance ci matrix``.

Standard library only (no pytest, no torch), so a CI matrix job can run it with just the
package installed (``pip install --no-deps``) as ``python -m lora_conformance.ci ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_conformance.ci import partition as part
from lora_conformance.ci.registry import (
    SUITES,
    RegistrationError,
    collect,
    display_path,
    select,
    suite_files,
    suites_for,
)


def _default_suites_dir() -> Path:
    from lora_conformance.settings import suites_dir  # imports pytest; only needed without --suites-dir

    return suites_dir()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ci_command", required=True, metavar="ACTION")
    lst = sub.add_parser("list", help="print every registration of every suite file")
    lst.add_argument("--suites-dir", type=Path, default=None, help="directory of suite files (default: suites/)")
    lst.add_argument("--hw", default=None, help="only this hardware kind")
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")

    mat = sub.add_parser("matrix", help="print a GitHub Actions matrix (JSON) of shards for one hw/suite")
    mat.add_argument("--hw", required=True, help=f"hardware kind ({', '.join(SUITES)}, or another name)")
    mat.add_argument("--suite", required=True, help="registered suite name")
    mat.add_argument("--shards", type=int, default=1, help="number of shards wanted (fewer when there are fewer files)")
    mat.add_argument("--nightly", action="store_true", help="include nightly registrations")
    mat.add_argument("--durations", default=None,
                     help="measured durations: JUnit XML, report.json or {file: seconds} JSON "
                          f"(default: ${part.DURATIONS_ENV}, else <suites-dir>/{part.DEFAULT_DURATIONS_NAME})")
    mat.add_argument("--suites-dir", type=Path, default=None, help="directory of suite files (default: suites/)")
    mat.add_argument("--indent", type=int, default=None, help="pretty-print the JSON (default: one line)")


def _list(args) -> int:
    root = args.suites_dir or _default_suites_dir()
    registry = collect(suite_files(root))
    rows = []
    unregistered = []
    for path, regs in registry.items():
        if not regs:
            unregistered.append(display_path(path))
        rows.extend(r.as_dict() for r in regs if args.hw in (None, r.hw))
    if args.json:
        print(json.dumps({"registrations": rows, "unregistered": unregistered}, indent=2))
        return 0
    header = ("file", "hw", "suite", "est_time", "nightly", "disabled")
    table = [header] + [(r["file"], r["hw"], r["suite"], f"{r['est_time']:g}", "yes" if r["nightly"] else "",
                         r["disabled"] or "") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for f in unregistered:
        print(f"unregistered (never run by CI): {f}")
    return 0


def matrix(root: Path, hw: str, suite: str, shards: int, nightly: bool = False,
           durations_file=None) -> dict:
    """The matrix as a dict (the CLI prints it as JSON)."""
    if suite not in suites_for(hw):
        raise ValueError(f"unknown suite {suite!r} for hardware {hw!r}; accepted: {', '.join(suites_for(hw))}")
    if shards < 1:
        raise ValueError("--shards must be >= 1")
    run, _disabled = select(collect(suite_files(root)), hw, suite, nightly)
    estimates = {p: reg.est_time for p, reg in run.items()}
    path = part.durations_path(durations_file, root)
    durations = part.load_durations(path) if path else None
    count = part.effective_shards(shards, len(estimates))
    include = []
    for shard, paths in part.split(estimates, count, durations, root):
        include.append({
            "shard": shard.index,
            "partition": f"{shard.index}/{count}",
            "files": [display_path(p) for p in paths],
            "est_time": shard.est_time,
        })
    return {"include": include}


def run(args) -> int:
    try:
        if args.ci_command == "list":
            return _list(args)
        root = args.suites_dir or _default_suites_dir()
        print(json.dumps(matrix(root, args.hw, args.suite, args.shards, args.nightly, args.durations),
                         indent=args.indent))
        return 0
    except (RegistrationError, ValueError, OSError) as exc:
        print(f"lora-conformance ci: error: {exc}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_conformance.ci", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
