"""Wall time of ``lora-conformance certify`` serial and with 2, 4, ... pytest-xdist workers, warm then cold.

    python bench/certify_time.py                         # cpu: workers 1, 2, 4, ... up to the cores; warm, then cold
    python bench/certify_time.py --workers 1,2 --skip-cold
    python bench/certify_time.py --device cuda --workers 1,8,16 --warm-cache /tmp/lora-cache
    python bench/certify_time.py --unshared              # also each N > 1 with every worker at all cores' threads
    python bench/certify_time.py --workers 1,2 --skip-cold --repeat 5   # noisy (shared, virtual) machines
    python bench/certify_time.py --engine builtin,vllm --python vllm=.venv-vllm/bin/python --workers 1 --skip-cold

``--engine`` takes several engines (comma-separated): each worker count is timed for each engine in
turn, side by side, so a slow spell of a shared machine hits them alike; ``--python ENGINE=PATH``
runs that engine's certification with another interpreter (vLLM lives in its own virtual env).

Warm: one untimed run fills a cache (or ``--warm-cache DIR`` names a filled one), then every worker
count is timed against it. Cold: every worker count starts from an empty cache of its own (models,
adapters and references are built again). Each row has the wall time, the speed-up over the serial
row of the same cache state, the cpu seconds of the whole process tree, the 1-minute load average
before and after and the cpu time the hypervisor gave to others meanwhile (steal: on a shared
machine wall times mean little without them), the engines the run started (count / seconds summed
over workers, from the report), the reference outputs it computed and found cached with the seconds
computing took (the report's ``reference.work``: a warm row computes none), on an accelerator the GiB
the largest worker held there and the sum over the workers (``device_memory``), and certify's exit code.

``--repeat R`` times every worker count R times, interleaved (1, 2, 1, 2, ...), so that a slow
spell of the machine hits every count alike; a closing table gives each count's median and range
and the median of the per-round speed-ups (each round's serial time over its own N-worker time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lora_conformance import parallel  # noqa: E402  (stdlib only)


def default_worker_counts(cores: int) -> list[int]:
    counts, n = [1], 2
    while n <= cores:
        counts.append(n)
        n *= 2
    if counts[-1] != cores and cores > 1:
        counts.append(cores)
    return counts


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def load1() -> float:
    return os.getloadavg()[0]


def steal_seconds() -> float:
    """CPU time the hypervisor ran other guests instead of this machine (Linux /proc/stat), all cpus."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# The certification running now. SIGTERM or SIGINT to this script (a device call's ``timeout``, Ctrl-C) is
# passed on to it, once:
# certify then stops pytest gracefully and writes the partial report, its row is printed (its exit code
# says it was interrupted), and no further row starts.
_RUNNING: list = []
_STOPPED: list = []


def _stop(signum, frame) -> None:
    if not _STOPPED:
        for proc in _RUNNING:
            proc.send_signal(signal.SIGTERM)
    _STOPPED.append(signum)


def certify(a, workers: int, cache: Path, report: Path, threads: str | None, engine: str | None = None) -> dict:
    engine = engine or a.engines[0]
    python = a.pythons.get(engine, sys.executable)
    cmd = [python, "-m", "lora_conformance.cli", "certify", "--device", a.device, "--engine", engine,
           "-n", str(workers), "--report", str(report)]
    cmd += [f"--engine-arg={e}" for e in a.engine_arg]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    cmd += ["--", f"--lora-cache={cache}", "-p", "no:cacheprovider", "-q"]
    if threads:
        cmd.append(f"--lora-threads={threads}")
    cmd += a.pytest_args
    before_load, before_cpu, before_steal = load1(), children_cpu(), steal_seconds()
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # A session of its own: a signal to this script's process group (``timeout`` sends one) reaches certify
    # only through _stop, once (a second SIGTERM would make certify stop pytest at once, with no report).
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                          start_new_session=True) as proc:
        _RUNNING[:] = [proc]
        stdout, stderr = proc.communicate()
        _RUNNING.clear()
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    wall = time.perf_counter() - start
    steal = steal_seconds() - before_steal
    tail = [ln for ln in out.stdout.splitlines() if " passed" in ln or " failed" in ln or "badge:" in ln]
    doc = read_report(report / "report.json")
    return {"starts": engine_starts(doc), "references": reference_work(doc), "device_gib": device_memory(doc),
            "engine": engine, "workers": workers, "threads": threads or "share", "wall_s": round(wall, 2),
            "cpu_s": round(children_cpu() - before_cpu, 2), "load_before": round(before_load, 2),
            "load_after": round(load1(), 2), "steal_s": round(steal, 2), "exit": out.returncode, "interrupted": bool(_STOPPED), "summary": tail[-2:] if tail else
            [(out.stdout + out.stderr).strip().splitlines()[-1:] or ["(no output)"]][0]}


def read_report(report_json: Path) -> dict:
    """The run's report.json ({} where it is missing or unreadable): read once for a row's columns."""
    try:
        doc = json.loads(report_json.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def engine_starts(doc: dict) -> str:
    """"N / S s": the engines the run started and their seconds summed over workers (the report's
    records), "-" where the report has none."""
    records = doc.get("records")
    if not isinstance(records, list):
        return "-"
    starts = [s for r in records for s in r.get("engine_starts") or ()]
    return f"{len(starts)} / {sum(float(s.get('seconds') or 0) for s in starts):.0f}"


def _environment(doc: dict, *keys: str) -> Optional[dict]:
    """``doc["environment"][keys...]`` where each level is an object, else None."""
    value = doc.get("environment")
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else None


def reference_work(doc: dict) -> str:
    """"computed / cached / s": the reference outputs the run computed and found cached, and the seconds
    computing took, summed over workers (the report's ``environment.reference.work``), "-" where none:
    a warm row computes 0."""
    work = _environment(doc, "reference", "work")
    if work is None:
        return "-"
    return f"{work.get('computed', 0):.0f} / {work.get('cache_hits', 0):.0f} / {work.get('compute_s', 0):.0f}"


def device_memory(doc: dict) -> str:
    """"L / S": GiB the largest worker held on the accelerator at once and the sum over the workers
    (the report's ``environment.device_memory``, torch's allocator), "-" on cpu or where none."""
    memory = _environment(doc, "device_memory")
    if memory is None:
        return "-"
    return f"{memory.get('largest_peak_reserved', 0) / 2**30:.1f} / {memory.get('summed_peak_reserved', 0) / 2**30:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", default="builtin", help="engine(s) to time, comma-separated (side by side)")
    p.add_argument("--python", action="append", default=[], metavar="ENGINE=PATH",
                   help="the interpreter for an engine's certification (default: this one)")
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--dtype", default=None)
    p.add_argument("--workers", default=None, help="comma-separated counts (default: 1, 2, 4, ... up to the cores)")
    p.add_argument("--cold-workers", default=None, help="counts for the cold runs (default: those of --workers)")
    p.add_argument("--warm-cache", type=Path, default=None, help="an already filled cache: no priming run")
    p.add_argument("--skip-cold", action="store_true")
    p.add_argument("--skip-warm", action="store_true")
    p.add_argument("--unshared", action="store_true",
                   help="also run each N > 1 with --lora-threads=<cores> (every worker at all cores: no thread share)")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="time each warm worker count R times, interleaved, and print medians (default 1)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    a = p.parse_args()
    a.pytest_args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    a.engines = [e for e in a.engine.split(",") if e]
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    a.pythons = dict(item.split("=", 1) for item in a.python)
    cores = parallel.cpu_cores()
    counts = [int(x) for x in a.workers.split(",")] if a.workers else default_worker_counts(cores)
    work = Path(tempfile.mkdtemp(prefix="certify-time-"))
    print(f"certify_time: device={a.device} engines={','.join(a.engines)} cores={cores} workers={counts} "
          f"load(1m)={load1():.2f} work={work}", flush=True)
    rows: list[dict] = []

    cold_counts = [int(x) for x in a.cold_workers.split(",")] if a.cold_workers else counts

    def timed(state: str, cache_for, counts: list[int], round_: int = 0) -> None:
        serial: dict[str, float] = {}
        for n in counts:
            variants = [None] + ([str(cores)] if a.unshared and n > 1 else [])
            for threads in variants:
                for engine in a.engines:
                    row = certify(a, n, cache_for(n, threads), work / f"report-{engine}-{state}-{n}-{threads}",
                                  threads, engine)
                    row["cache"], row["round"] = state, round_
                    if n == 1 and threads is None:
                        serial[engine] = row["wall_s"]
                    s = serial.get(engine)
                    row["speedup"] = round(s / row["wall_s"], 2) if s else None  # None: no serial row
                    rows.append(row)
                    print(fmt(row), flush=True)
                    if _STOPPED:
                        print(f"certify_time: stopped by {signal.Signals(_STOPPED[0]).name}: the row above is the "
                              "interrupted run's; no further row started", flush=True)
                        return

    print(header(), flush=True)
    if not a.skip_warm:
        warm = a.warm_cache
        if warm is None:
            warm = work / "warm-cache"
            for engine in a.engines:
                prime = certify(a, max(counts), warm, work / f"report-prime-{engine}", None, engine)
                print(f"(priming run, {engine}: {prime['wall_s']} s, exit {prime['exit']})", flush=True)
        for round_ in range(max(1, a.repeat)):
            if not _STOPPED:
                timed("warm", lambda n, t: warm, counts, round_)
        if a.repeat > 1:
            print(summary([r for r in rows if r["cache"] == "warm"]), flush=True)
    if not a.skip_cold and not _STOPPED:
        timed("cold", lambda n, t: work / f"cold-cache-{n}-{t}", cold_counts)
    if a.json:
        a.json.write_text(json.dumps({"cores": cores, "device": a.device, "engines": a.engines, "rows": rows},
                                     indent=2))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


def summary(rows: list[dict]) -> str:
    """Median and range of each worker count's wall time over the rounds, and the median per-round
    speed-up over that round's serial time."""
    from statistics import median

    lines = [f"warm, {len({r['round'] for r in rows})} rounds interleaved:",
             f"{'engine':>8} {'workers':>7} {'threads':>8} {'median s':>9} {'min-max s':>13} {'median speed-up':>16} "
             f"{'per-round speed-ups':>20}"]
    keys = sorted({(r.get("engine", ""), r["workers"], r["threads"]) for r in rows},
                  key=lambda k: (k[0], k[1], str(k[2])))
    for engine, workers, threads in keys:
        mine = [r for r in rows if (r.get("engine", ""), r["workers"], r["threads"]) == (engine, workers, threads)]
        walls = [r["wall_s"] for r in mine]
        ups = [r["speedup"] for r in mine if r["speedup"]]
        up = f"{median(ups):.2f}x" if ups and workers > 1 else "-"
        each = " ".join(f"{u:.2f}" for u in ups) if workers > 1 else ""
        lines.append(f"{engine:>8} {workers:>7} {threads:>8} {median(walls):>9.1f} {min(walls):>6.1f}-{max(walls):<6.1f} "
                     f"{up:>16} {each:>20}")
    return "\n".join(lines)


def header() -> str:
    return (f"{'engine':8} {'cache':6} {'workers':>7} {'threads':>8} {'wall s':>8} {'speed-up':>8} {'cpu s':>8} "
            f"{'load 1m before/after':>21} {'steal s':>7} {'starts / s':>11} {'ref computed/cached/s':>21} "
            f"{'device GiB max/sum':>18}  exit  summary")


def fmt(r: dict) -> str:
    speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
    load = f"{r['load_before']:.1f} / {r['load_after']:.1f}"
    return (f"{r.get('engine', ''):8} {r['cache']:6} {r['workers']:>7} {r['threads']:>8} {r['wall_s']:>8.1f} {speed:>8} {r['cpu_s']:>8.1f} "
            f"{load:>21} {r.get('steal_s', 0):>7.1f} {r.get('starts', '-'):>11} {r.get('references', '-'):>21} "
            f"{r.get('device_gib', '-'):>18}  {r['exit']:>4}  "
            f"{' | '.join(r['summary'])}")


if __name__ == "__main__":
    sys.exit(main())
