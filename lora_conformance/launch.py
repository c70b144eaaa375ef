"""``lora-conformance certify``: run the suites against one engine on one device, write the report.

A thin wrapper: it runs pytest (in a child process, so the engine's device state dies with
it) on the suites directory with the plugin's options as given plus ``--lora-report DIR``, then
says where the report is and what the badge reads. The exit code is pytest's. Those options are
the plugin's own table (``lora_conformance.options``), not a copy: certify declares none of them.

Unless told (``-n/--workers N``, or ``-n`` among the pytest arguments), it asks pytest-xdist for
``-n auto``, and the plugin's ``pytest_xdist_auto_num_workers`` hook chooses the workers from the
machine and the run's settings (``lora_conformance.parallel.workers_for_run``), exactly as
``pytest suites -n auto`` does; the run's header shows the choice and why. Each worker then takes
its share of the cores (the plugin's thread share). The options are resolved once, by the plugin
(command line, environment, ini, default): certify passes them on and decides nothing from them.

The run loads only the pytest plugins the suites need (``SUITE_PLUGINS``: ours, pytest-xdist and
hypothesis's), not every installed one: a plugin that reruns failures, reorders or reseeds tests
or times them out would change a certification's verdict, and each auto-loaded plugin costs every
worker its start-up. ``--autoload-plugins`` restores pytest's default; ``-- -p NAME`` adds one.

Interrupts: pytest runs in a process group of its own. Ctrl-C (SIGINT) or SIGTERM to certify is
forwarded to that whole group as SIGINT, pytest's graceful stop (the terminal's Ctrl-C reaches
every pytest-xdist worker the same way): tests stop, fixtures are torn down, so engines close and
stop the servers they started, and the report of the tests run so far is written, marked
``interrupted``. certify waits ``INTERRUPT_GRACE_S`` for that, then sends SIGTERM and, after
``processes.KILL_GRACE_S``, SIGKILL (a second Ctrl-C or SIGTERM skips the wait). Whatever is left of the
group, and (on Linux, where certify makes itself the subreaper of its descendants) any process
the run started that outlived its parent, such as a server whose worker was killed, is then
terminated: nothing the run started keeps running after certify returns.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from lora_conformance import processes

REPORT_FILES = ("report.json", "report.md", "report.html", "badge.svg")
# The plugins a certification loads (with pytest's auto-loading off), each where it is installed.
SUITE_PLUGINS = ("lora_conformance.plugin", "xdist.plugin", "_hypothesis_pytestplugin")
NO_TESTS_COLLECTED = 5
CERTIFY_INI = "certify.ini"  # in the bundled suites: the run's only pytest configuration
INTERRUPT_GRACE_S = 60.0  # for pytest to stop, close engines and write the partial report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lora_conformance import options

    parser.add_argument("--report", type=Path, default=Path("lora-report"),
                        help="report directory (default: ./lora-report)")
    parser.add_argument("--suite-dir", type=Path, default=None, help="suites to run (default: the bundled suites/)")
    parser.add_argument("-n", "--workers", default=None, metavar="N|auto",
                        help="pytest-xdist worker processes (default: auto, chosen from cores, devices and memory; "
                             "1 runs in one process)")
    parser.add_argument("--certified", action="store_true", dest="lora_certified", default=None,
                        help="a certified run, what a published badge requires (the same as --lora-certified; "
                             "docs/certifying.md): refuses to start when narrowed")
    parser.add_argument("--autoload-plugins", action="store_true",
                        help="load every installed pytest plugin, as plain pytest does (default: only "
                             + ", ".join(SUITE_PLUGINS) + "; add others with -- -p NAME)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: extra pytest arguments (e.g. -- -n 4 -k mixed_batch)")
    # The plugin's options, from its one table; --report stands for --lora-report.
    options.add_arguments(parser, leave_out=("lora_report",), required=("device",))


def _extra_args(args) -> list[str]:
    extra = list(args.pytest_args or ())
    return extra[1:] if extra[:1] == ["--"] else extra


def _gives_workers(extra: Sequence[str]) -> bool:
    """Whether the pytest arguments already choose pytest-xdist workers (-n N, -nN, --numprocesses)."""
    return any(a == "--numprocesses" or a.startswith("--numprocesses=") or (a.startswith("-n") and not a.startswith("--"))
               for a in extra)


def worker_arguments(args, xdist_installed: Optional[bool] = None) -> tuple[list[str], str]:
    """(the pytest arguments that choose the workers, what to print about them). ``-n auto`` unless
    told: the plugin's xdist hook then chooses (``parallel.workers_for_run``). Raises ValueError for
    a bad or doubly given -n."""
    from lora_conformance import parallel

    if _gives_workers(_extra_args(args)):
        if args.workers is not None:
            raise ValueError(f"-n/--workers {args.workers} and -n among the pytest arguments after --: give one")
        return [], "as the pytest arguments after -- say"
    told = parallel.parse_workers(args.workers or "auto")
    if xdist_installed is None:
        import importlib.util

        xdist_installed = importlib.util.find_spec("xdist") is not None
    if not xdist_installed:
        return [], "1: pytest-xdist is not installed, so one process (pip install pytest-xdist)"
    if told is None:
        return ["-n", "auto"], "auto: the plugin chooses from the machine and the run's settings (the header says why)"
    return (["-n", str(told)] if told > 1 else []), f"{told} (-n/--workers)"


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


def _slow_start(engine: str) -> bool:
    """The engine class says its start is slow (``Engine.slow_start``); an engine that cannot be
    found is left to the run to report."""
    from lora_conformance.engines import engine_class

    try:
        return bool(getattr(engine_class(engine), "slow_start", False))
    except Exception:  # noqa: BLE001 - a bad engine name is reported by the run itself, in one line
        return False


def pytest_command(args, workers: Sequence[str] = ()) -> list[str]:
    from lora_conformance import options
    from lora_conformance.settings import suites_dir

    suite_dir = Path(args.suite_dir or suites_dir()).resolve()
    cmd = [sys.executable, "-m", "pytest", str(suite_dir), *options.as_pytest_arguments(args)]
    if not args.autoload_plugins:
        if _autoload_env(args) is None:
            cmd.append("--disable-plugin-autoload")  # else run() passes the environment variable
        for name in suite_plugins():
            cmd += ["-p", name]
    else:
        cmd += ["-p", SUITE_PLUGINS[0]]  # installed, it is not auto-loaded (lora_conformance.autoload)
    # Wherever the package is installed: this configuration only, test ids suites/test_*.py::...
    # pytest's cache (--lf, --ff) where pytest run here would keep it, never inside an installed package.
    cmd += ["-c", str(suites_dir() / CERTIFY_INI), f"--rootdir={suite_dir.parent}", f"--confcutdir={suite_dir}",
            "-o", f"cache_dir={Path.cwd() / '.pytest_cache'}"]
    if workers:
        cmd += list(workers)
        if _slow_start(args.engine) and not any(a == "--dist" or a.startswith("--dist=") for a in _extra_args(args)):
            cmd += ["--dist", "loadfile"]
    cmd.append(f"--lora-report={Path(args.report).resolve()}")
    return cmd + _extra_args(args)


def badge_line(report_dir: Path) -> Optional[str]:
    """The badge's words and the run's status (``certified``, ``partial: N of M features``, ...)."""
    from lora_conformance.report.document import ReportFormatError, load_report, reverify, status_line

    try:
        report = load_report(report_dir)
    except ReportFormatError:
        return None
    return status_line(report, reverify(report)[0])


def _engine_config_error(args) -> Optional[str]:
    """The engine configuration checked before pytest starts (the plugin checks it again, with the
    environment and ini values): one line, or None when it is fine."""
    from lora_conformance import options
    from lora_conformance.engines.args import engine_arg_pairs
    from lora_conformance.engines.registry import check_engine_config
    from lora_conformance.errors import EngineError

    try:
        check_engine_config(options.given_or_default(args, "engine"), engine_arg_pairs(args.engine_arg),
                            "command line")
    except (EngineError, ValueError) as exc:
        return str(exc)
    return None


def run_pytest(cmd: Sequence[str], env: Optional[dict] = None, grace_s: Optional[float] = None) -> int:
    """Run ``cmd`` in its own process group; forward SIGINT and SIGTERM to it as SIGINT; wait
    (bounded) for it to stop; leave nothing it started running. Returns its exit code, or
    128 + the signal when the run was interrupted and pytest said nothing better."""
    grace_s = INTERRUPT_GRACE_S if grace_s is None else grace_s
    processes.become_subreaper()
    received: list[int] = []
    first_at = [0.0]
    proc: Optional[subprocess.Popen] = None

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            first_at[0] = time.monotonic()
            print(f"\nlora-conformance certify: {signal.Signals(signum).name}: stopping pytest (engines close, "
                  f"the partial report is written; up to {grace_s:.0f} s, again to stop at once)",
                  file=sys.stderr, flush=True)
        if proc is not None:  # before pytest started: it is sent the SIGINT once it has
            processes.signal_group(proc.pid, signal.SIGINT if len(received) == 1 else signal.SIGTERM)

    # The handlers before pytest starts: at exec a caught signal goes back to its default, an ignored
    # one stays ignored, and a background job of a non-interactive shell (``certify ... &`` in a script,
    # nohup) starts with SIGINT ignored: pytest would ignore the SIGINT that stops it, and the run would
    # end only at the grace's SIGTERM, without its report.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    escalated = False
    try:
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
        if received:
            processes.signal_group(proc.pid, signal.SIGINT)
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and not escalated and time.monotonic() - first_at[0] > grace_s:
                print(f"lora-conformance certify: pytest did not stop within {grace_s:.0f} s; terminating it",
                      file=sys.stderr, flush=True)
                processes.signal_group(proc.pid, signal.SIGTERM)
                escalated = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stopped = processes.stop_leftovers(proc.pid) if proc is not None else []
        if stopped:
            print(f"lora-conformance certify: stopped {len(stopped)} process(es) the run left behind "
                  f"(pids {', '.join(map(str, stopped))})", file=sys.stderr, flush=True)
    if received and code == 0:  # interrupted, whatever the child made of it: never a clean pass
        return 128 + received[0]
    return code


def check_report_dir(report_dir: Path) -> Optional[str]:
    """None, or why the report cannot be written there (checked before the run, not after it)."""
    from lora_conformance.fileio import CacheEnvironmentError, check_writable_dir

    try:
        check_writable_dir(report_dir, "the report directory (--report)", "the report is written there at the "
                                                                          "end: give a writable --report")
    except CacheEnvironmentError as exc:
        return str(exc)
    return None


def exit_text(code: int, workers: bool = True) -> str:
    """pytest's exit status as a reader needs it: a signal by name, with what to do where pytest
    itself died (a segfault in an engine's native code, run without ``workers``, takes the report too)."""
    if code >= 0:
        return f"pytest exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    said = f"pytest was killed by {name}"
    if not workers and -code in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
        said += ("; a crash in the engine's native code ends a run without workers: with -n 2 or more, "
                 "pytest-xdist isolates it and the report records the crashed case")
    return said


def run(args, runner=None) -> int:
    if args.lora_certified:
        from lora_conformance.certification import launch_refusal

        refusal = launch_refusal(_extra_args(args), args.suite_dir)
        if refusal:
            print(f"lora-conformance certify: error: --certified: {refusal}; nothing was run", file=sys.stderr)
            return 2
    try:
        workers, workers_said = worker_arguments(args)
    except ValueError as exc:
        print(f"lora-conformance certify: error: {exc}", file=sys.stderr)
        return 2
    report_dir = Path(args.report).resolve()
    problem = check_report_dir(report_dir)
    if problem is not None:
        print(f"lora-conformance certify: error: {problem}", file=sys.stderr)
        return 2
    # A stale report from an earlier run must never pass for this one's.
    for name in REPORT_FILES:
        (report_dir / name).unlink(missing_ok=True)
    error = _engine_config_error(args)
    if error:
        print(f"lora-conformance certify: error: {error}; nothing was run, no report was written", file=sys.stderr)
        return 2
    print(f"workers: {workers_said}", flush=True)
    cmd = pytest_command(args, workers)
    if not args.autoload_plugins:
        print(f"plugins: {', '.join(suite_plugins())} (other installed pytest plugins are not loaded: "
              "add one with -- -p NAME, or all with --autoload-plugins)", flush=True)
    env = _autoload_env(args)
    print("running: " + ("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " if env else "") + " ".join(cmd), flush=True)
    if runner is None:
        code = run_pytest(cmd, env)
    else:
        code = int(runner(cmd, env=env) if env else runner(cmd))
    if code == NO_TESTS_COLLECTED:
        print(f"lora-conformance certify: error: no tests were collected from {cmd[3]} "
              "(check --suite-dir and any -k/-m given after --); nothing was certified", file=sys.stderr)
        return code
    line = badge_line(report_dir)
    if line is None:
        said = exit_text(code, bool(workers) or _gives_workers(_extra_args(args)))
        print(f"lora-conformance certify: no report was written ({said})", file=sys.stderr)
        return 128 - code if code < 0 else (code or 1)  # a signal as shells report it (139: SIGSEGV)
    print(f"report: {report_dir / 'report.html'}")
    print(f"badge:  {report_dir / 'badge.svg'}  ({line})")
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-conformance certify")
    add_arguments(parser)
    return run(parser.parse_args(argv))
