"""N concurrent suite processes on one cache, cold then warm: no failure a single process would not have.

    python bench/stress_cache.py [-n 4] [--suites suites/test_bad_input.py,suites/test_prefix_cache.py]
                                 [--engine builtin] [--dtype float32] [--rounds 1] [--keep DIR]

The suites' test ids are collected once and dealt round-robin to N processes (as pytest-xdist
would: each process starts with a different test, on its own fresh engine), all started at once on
one empty ``--lora-cache`` (cold: every process races to build the models, adapters, base shapes
and references), then again on the now warm cache. A single process then runs every test on a
third, cold cache: the baseline. Each process gets ``cores // N`` torch threads (the plugin's
share). The result lists, per phase, failed or errored test ids and those the baseline did not
have; exit code 1 when any phase has a failure the baseline does not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collect(suites: list[str], common: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *suites, *common],
                         cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.exit(f"stress_cache: nothing collected:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return ids


def failures(junit: Path) -> set[str]:
    """Failed or errored test ids from a junit xml (a missing file: the process died: '<crash>')."""
    try:
        tree = ET.parse(junit)
    except (OSError, ET.ParseError):
        return {"<crash: no junit xml>"}
    bad = set()
    for case in tree.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            bad.add(f"{case.get('classname')}::{case.get('name')}")
    return bad


def run_phase(name: str, shares: list[list[str]], cache: Path, common: list[str], threads: int,
              work: Path) -> tuple[set[str], float, list[str]]:
    procs = []
    t0 = time.monotonic()
    for i, ids in enumerate(shares):
        junit = work / f"{name}-{i}.xml"
        log = open(work / f"{name}-{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", *ids, *common, f"--lora-cache={cache}", f"--lora-threads={threads}",
               f"--junitxml={junit}", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), junit, log))
    bad: set[str] = set()
    codes = []
    for p, junit, log in procs:
        codes.append(str(p.wait()))
        log.close()
        bad |= failures(junit)
    return bad, time.monotonic() - t0, codes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--processes", type=int, default=4)
    ap.add_argument("--suites", default="suites/test_bad_input.py,suites/test_prefix_cache.py")
    ap.add_argument("--engine", default="builtin")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=1, help="cold+warm rounds (each on a new cold cache)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-process baseline")
    ap.add_argument("--keep", type=Path, default=None, help="keep caches, logs and junit files here")
    a = ap.parse_args(argv)
    common = [f"--device={a.device}", f"--engine={a.engine}", f"--dtype={a.dtype}"]
    work = Path(a.keep or tempfile.mkdtemp(prefix="stress-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    ids = collect(a.suites.split(","), common)
    n = max(1, a.processes)
    shares = [ids[i::n] for i in range(n)]
    threads = max(1, (os.cpu_count() or 1) // n)
    print(f"stress_cache: {len(ids)} tests from {a.suites} over {n} processes ({threads} torch threads each), "
          f"{a.engine} {a.device} {a.dtype}; work dir {work}", flush=True)
    rows = []
    for r in range(a.rounds):
        cache = work / f"cache-{r}"
        for phase in ("cold", "warm"):
            bad, took, codes = run_phase(f"r{r}-{phase}", shares, cache, common, threads, work)
            rows.append((f"round {r} {phase}", bad, took, codes))
            print(f"round {r} {phase}: {took:.0f} s, exit codes {','.join(codes)}, {len(bad)} failed: "
                  f"{sorted(bad)}", flush=True)
    base: set[str] = set()
    if not a.no_baseline:
        base, took, codes = run_phase("baseline", [ids], work / "cache-baseline", common,
                                      os.cpu_count() or 1, work)
        print(f"baseline (1 process, cold): {took:.0f} s, exit code {codes[0]}, {len(base)} failed: {sorted(base)}")
    extra = {name: sorted(bad - base) for name, bad, _, _ in rows if bad - base}
    print("\nphase                 seconds  failed  not in baseline")
    for name, bad, took, _ in rows:
        print(f"{name:<20}{took:>9.0f}{len(bad):>8}{len(bad - base):>17}")
    if extra:
        print(f"FAILURES A SINGLE PROCESS DID NOT HAVE: {extra}")
        return 1
    print(f"no failure beyond the single-process baseline ({n} processes, {a.rounds} round(s) cold + warm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
