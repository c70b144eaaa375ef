"""``lora-conformance certify``: run the suites against one engine on one device, write the report.

A thin wrapper: it runs pytest (in a child process, so the engine's device state dies with
it) on the suites directory with the plugin's options plus ``--lora-report DIR``, then says
where the report is and what the badge reads. The exit code is pytest's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPORT_FILES = ("report.json", "report.md", "report.html", "badge.svg")
NO_TESTS_COLLECTED = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", required=True, help="device under test (cpu, cuda, xpu, ..., auto)")
    parser.add_argument("--engine", default="builtin", help="engine under test (registered name or module:Class; default: builtin)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="engine argument (repeatable)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="dtype of the engine under test")
    parser.add_argument("--base-model", default=None, help="synthetic:llama (default), ... or a local checkpoint")
    parser.add_argument("--report", type=Path, default=Path("lora-report"),
                        help="report directory (default: ./lora-report)")
    parser.add_argument("--suite-dir", type=Path, default=None, help="suites to run (default: the bundled suites/)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: extra pytest arguments (e.g. -- -n 4 -k mixed_batch)")


def pytest_command(args) -> list[str]:
    from lora_conformance.settings import suites_dir

    suite_dir = args.suite_dir or suites_dir()
    cmd = [sys.executable, "-m", "pytest", str(suite_dir), f"--device={args.device}", f"--engine={args.engine}"]
    cmd += [f"--engine-arg={a}" for a in args.engine_arg]
    if args.dtype:
        cmd.append(f"--dtype={args.dtype}")
    if args.base_model:
        cmd.append(f"--base-model={args.base_model}")
    cmd.append(f"--lora-report={Path(args.report).resolve()}")
    extra = list(args.pytest_args or ())
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return cmd + extra


def badge_line(report_dir: Path) -> Optional[str]:
    try:
        data = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    summary = data["verdict"]["summary"]
    device = ((data.get("environment") or {}).get("device") or {}).get("type") or "unknown"
    verdict = "certified" if summary["certified"] else "not certified"
    return f"LoRA conformance · {device} · {summary['features_passed']}/{summary['features_counted']} ({verdict})"


def run(args, runner=subprocess.call) -> int:
    report_dir = Path(args.report).resolve()
    # A stale report from an earlier run must never pass for this one's.
    for name in REPORT_FILES:
        (report_dir / name).unlink(missing_ok=True)
    cmd = pytest_command(args)
    print("running: " + " ".join(cmd), flush=True)
    code = int(runner(cmd))
    if code == NO_TESTS_COLLECTED:
        print(f"lora-conformance certify: error: no tests were collected from {cmd[3]} "
              "(check --suite-dir and any -k/-m given after --); nothing was certified", file=sys.stderr)
        return code
    line = badge_line(report_dir)
    if line is None:
        print(f"lora-conformance certify: no report was written (pytest exit code {code})", file=sys.stderr)
        return code or 1
    print(f"report: {report_dir / 'report.html'}")
    print(f"badge:  {report_dir / 'badge.svg'}  ({line})")
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-conformance certify")
    add_arguments(parser)
    return run(parser.parse_args(argv))
