"""``lora-conformance certify``: run the suites against one engine on one device, write the report.

A thin wrapper: it runs pytest (in a child process, so the engine's device state dies with
it) on the suites directory with the plugin's options plus ``--lora-report DIR``, then says
where the report is and what the badge reads. The exit code is pytest's.

Unless told (``-n/--workers N``, or ``-n`` among the pytest arguments), it spreads the run over
pytest-xdist workers chosen from the machine (``lora_conformance.parallel.choose_workers``) and
prints that choice; each worker then takes its share of the cores (the plugin's thread share).

The run loads only the pytest plugins the suites need (``SUITE_PLUGINS``: ours, pytest-xdist and
hypothesis's), not every installed one: a plugin that reruns failures, reorders or reseeds tests
or times them out would change a certification's verdict, and each auto-loaded plugin costs every
worker its start-up. ``--autoload-plugins`` restores pytest's default; ``-- -p NAME`` adds one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from lora_conformance.checkpoints import DTYPE_NAMES

REPORT_FILES = ("report.json", "report.md", "report.html", "badge.svg")
# The plugins a certification loads (with pytest's auto-loading off), each where it is installed.
SUITE_PLUGINS = ("lora_conformance.plugin", "xdist.plugin", "_hypothesis_pytestplugin")
NO_TESTS_COLLECTED = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", required=True, help="device under test (cpu, cuda, xpu, ..., auto)")
    parser.add_argument("--engine", default="builtin", help="engine under test (registered name or module:Class; default: builtin)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="engine argument (repeatable)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="dtype of the engine under test")
    parser.add_argument("--base-model", default=None, help="synthetic:llama (default), ... or a local checkpoint")
    parser.add_argument("--report", type=Path, default=Path("lora-report"),
                        help="report directory (default: ./lora-report)")
    parser.add_argument("--suite-dir", type=Path, default=None, help="suites to run (default: the bundled suites/)")
    parser.add_argument("-n", "--workers", default=None, metavar="N|auto",
                        help="pytest-xdist worker processes (default: auto, chosen from cores, devices and memory; "
                             "1 runs in one process)")
    parser.add_argument("--autoload-plugins", action="store_true",
                        help="load every installed pytest plugin, as plain pytest does (default: only "
                             + ", ".join(SUITE_PLUGINS) + "; add others with -- -p NAME)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: extra pytest arguments (e.g. -- -n 4 -k mixed_batch)")


def _extra_args(args) -> list[str]:
    extra = list(args.pytest_args or ())
    return extra[1:] if extra[:1] == ["--"] else extra


def _gives_workers(extra: Sequence[str]) -> bool:
    """Whether the pytest arguments already choose pytest-xdist workers (-n N, -nN, --numprocesses)."""
    return any(a == "--numprocesses" or a.startswith("--numprocesses=") or (a.startswith("-n") and not a.startswith("--"))
               for a in extra)


def _devices_for(spec: str) -> tuple[str, int]:
    """The device type a run will use and how many of them its workers can spread over."""
    if spec.strip() == "cpu":
        return "cpu", 1  # no torch import for a cpu run
    from lora_conformance import devices

    try:
        resolved = devices.resolve_device(spec)
    except devices.DeviceError:
        return "cpu", 1  # pytest reports the bad --device itself, with the accepted values
    kind = devices.device_type(resolved)
    if kind == "cpu":
        return "cpu", 1
    one_device = ":" in spec  # cuda:1 pins every worker to that device
    return kind, 1 if one_device else max(1, devices.device_count(kind))


def _cache_dir(args) -> Path:
    """The cache the run will use: --lora-cache among the pytest arguments, else its environment
    variable, else the default (the plugin's own precedence; an ini key is not looked at here)."""
    from lora_conformance.options import BY_NAME
    from lora_conformance.settings import default_cache_dir

    extra = _extra_args(args)
    for i, a in enumerate(extra):
        if a.startswith("--lora-cache="):
            return Path(a.split("=", 1)[1]).expanduser()
        if a == "--lora-cache" and i + 1 < len(extra):
            return Path(extra[i + 1]).expanduser()
    env = os.environ.get(BY_NAME["lora_cache"].env)
    return Path(env).expanduser() if env else default_cache_dir()


def recorded_work(args, device_type: str) -> Optional[float]:
    """Seconds of the suites' tests that earlier runs with this engine, device type and dtype recorded
    (None: none). The durations file also holds other runs' tests (our own tests, other suite
    directories): only node ids of a test file in this suite directory count."""
    from lora_conformance import schedule
    from lora_conformance.devices import default_dtype_for
    from lora_conformance.settings import suites_dir

    suite_dir = Path(args.suite_dir or suites_dir())
    files = {f"{suite_dir.name}/{f.name}" for f in suite_dir.glob("test_*.py")}
    dtype = args.dtype or default_dtype_for(device_type)
    durations = schedule.load(schedule.durations_path(_cache_dir(args), args.engine, device_type, dtype))
    mine = [d for nodeid, d in durations.items() if "/".join(nodeid.split("::")[0].split("/")[-2:]) in files]
    return sum(mine) or None


def choose_workers(args, xdist_installed: Optional[bool] = None):
    """The worker count for this run (a parallel.WorkerChoice), or None where the pytest arguments
    after -- already give one. Raises ValueError for a bad or doubly given -n."""
    from lora_conformance import parallel

    if _gives_workers(_extra_args(args)):
        if args.workers is not None:
            raise ValueError(f"-n/--workers {args.workers} and -n among the pytest arguments after --: give one")
        return None
    told = parallel.parse_workers(args.workers or "auto")
    if told is not None:
        choice = parallel.WorkerChoice(told, "-n/--workers")
    else:
        kind, count = _devices_for(args.device)
        choice = parallel.choose_workers(parallel.cpu_cores(), parallel.available_memory(), kind, count,
                                         recorded_work(args, kind))
    if xdist_installed is None:
        import importlib.util

        xdist_installed = importlib.util.find_spec("xdist") is not None
    if choice.workers > 1 and not xdist_installed:
        return parallel.WorkerChoice(1, f"pytest-xdist is not installed, so one process (instead of {choice.workers}, "
                                        f"{choice.reason}); pip install pytest-xdist")
    return choice


def suite_plugins() -> list[str]:
    """The installed ones of ``SUITE_PLUGINS`` (pytest-xdist and hypothesis are optional)."""
    import importlib.util

    return [name for name in SUITE_PLUGINS if importlib.util.find_spec(name.split(".")[0]) is not None]


def _pytest_has_autoload_flag() -> bool:
    """pytest 8.4 added --disable-plugin-autoload; older ones read PYTEST_DISABLE_PLUGIN_AUTOLOAD only."""
    import pytest

    try:
        return tuple(int(p) for p in pytest.__version__.split(".")[:2]) >= (8, 4)
    except ValueError:  # a development version: assume a recent one
        return True


def _autoload_env(args) -> Optional[dict]:
    """The environment that turns pytest's plugin auto-loading off, where the command line cannot
    (a pytest before 8.4, without --disable-plugin-autoload); else None."""
    if args.autoload_plugins or _pytest_has_autoload_flag():
        return None
    return dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def pytest_command(args, workers: Optional[int] = None) -> list[str]:
    from lora_conformance.settings import suites_dir

    suite_dir = args.suite_dir or suites_dir()
    cmd = [sys.executable, "-m", "pytest", str(suite_dir), f"--device={args.device}", f"--engine={args.engine}"]
    if not args.autoload_plugins:
        if _autoload_env(args) is None:
            cmd.append("--disable-plugin-autoload")  # else run() passes the environment variable
        for name in suite_plugins():
            cmd += ["-p", name]
    cmd += [f"--engine-arg={a}" for a in args.engine_arg]
    if args.dtype:
        cmd.append(f"--dtype={args.dtype}")
    if args.base_model:
        cmd.append(f"--base-model={args.base_model}")
    if workers is not None and workers > 1:
        cmd += ["-n", str(workers)]
    cmd.append(f"--lora-report={Path(args.report).resolve()}")
    return cmd + _extra_args(args)


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
    try:
        choice = choose_workers(args)
    except ValueError as exc:
        print(f"lora-conformance certify: error: {exc}", file=sys.stderr)
        return 2
    report_dir = Path(args.report).resolve()
    # A stale report from an earlier run must never pass for this one's.
    for name in REPORT_FILES:
        (report_dir / name).unlink(missing_ok=True)
    if choice is None:
        print("workers: as the pytest arguments after -- say", flush=True)
    else:
        print(f"workers: {choice.workers} ({choice.reason})", flush=True)
    cmd = pytest_command(args, None if choice is None else choice.workers)
    if not args.autoload_plugins:
        print(f"plugins: {', '.join(suite_plugins())} (other installed pytest plugins are not loaded: "
              "add one with -- -p NAME, or all with --autoload-plugins)", flush=True)
    env = _autoload_env(args)
    print("running: " + ("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " if env else "") + " ".join(cmd), flush=True)
    code = int(runner(cmd, env=env) if env else runner(cmd))
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
