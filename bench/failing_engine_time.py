"""How long a failing engine takes to judge: the whole ``mixed_batch`` suite against the built-in engine
with a routing fault injected (``--engine-arg fault=NAME``), through ``lora-conformance certify``.

    python bench/failing_engine_time.py [--fault adapter_index_off_by_one] [-n 2] [--runs 1]

Prints, per run: wall seconds, CPU seconds of the run's processes (user + system, children
included), the machine's load average before and after (a shared machine's wall time depends on
it), the per-test durations over 2 s, and the badge line. The bar: under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(fault: str, workers: str, report: Path) -> dict:
    cmd = [sys.executable, "-m", "lora_conformance.cli", "certify", "--device", "cpu", "--engine-arg", f"fault={fault}",
           "-n", workers, "--report", str(report), "--", "-k", "mixed_batch", "--durations=0", "--durations-min=2"]
    load_before = os.getloadavg()
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    durations = [l for l in done.stdout.splitlines() if re.match(r"^\s*\d+\.\d+s (call|setup|teardown) ", l)]
    badge = next((l for l in done.stdout.splitlines() if l.startswith("badge:")), "badge: none")
    return {"wall": wall, "cpu": cpu, "load_before": load_before, "load_after": os.getloadavg(), "exit": done.returncode,
            "durations": durations, "badge": badge}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", default="adapter_index_off_by_one")
    parser.add_argument("-n", "--workers", default="2")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(args.fault, args.workers, Path(tmp) / "report")
        load = lambda l: "/".join(f"{x:.1f}" for x in l)  # noqa: E731
        print(f"run {i + 1}: wall {r['wall']:.1f} s, cpu {r['cpu']:.1f} s (processes waited for; pytest-xdist workers may be missing), exit {r['exit']}, "
              f"load {load(r['load_before'])} -> {load(r['load_after'])} (1/5/15 min), {os.cpu_count()} cores")
        print("\n".join(r["durations"]))
        print(r["badge"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
