"""Certify an engine once per execution mode it declares, and combine: a feature passes only where it
passes in every mode.

    python bench/certify_modes.py --device cuda --out /tmp/modes                 # builtin: eager, compile, graphs
    python bench/certify_modes.py --device cuda --modes compile,graphs --out DIR -- --profile full
    python bench/certify_modes.py --engine vllm --device cuda --out DIR          # enforce_eager=1, then 0

Each mode is one ``lora-conformance certify`` run with that mode's engine arg (``Engine.exec_modes``:
the builtin engine's ``exec_mode=eager|compile|graphs``, vLLM's ``enforce_eager=1|0``), its report in
``OUT/<value>/``; the arguments after ``--`` go to every run. ``OUT/modes.json`` and ``OUT/modes.md``
give, per feature, its status in each mode and the combined status (passed only where passed in
every mode that ran; failed where any mode failed), which modes ran, each run's wall time and exit
code. The exit code is 0 only when every mode's run certified.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The order in which one mode's status outranks another's in the combination (worst first).
WORST_FIRST = ("failed", "error", "xfail", "not certified", "skipped", "passed")


def combine(per_mode: dict[str, dict]) -> dict[str, dict]:
    """feature id -> {"modes": {mode: status}, "status": the worst status over the modes}; a feature
    missing from a mode's report counts as "not run" there (and the combination is then not passed)."""
    features = sorted({f for statuses in per_mode.values() for f in statuses})
    out = {}
    for f in features:
        modes = {m: statuses.get(f, "not run") for m, statuses in per_mode.items()}
        ranked = [s for s in WORST_FIRST if s in modes.values()]
        status = "not run" if "not run" in modes.values() else ranked[0] if ranked else "not run"
        out[f] = {"modes": modes, "status": status}
    return out


def feature_statuses(report_json: Path) -> dict[str, str]:
    data = json.loads(report_json.read_text())
    return {fid: f["status"] for fid, f in data["verdict"]["features"].items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="builtin")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--modes", default=None, help="comma-separated values of the mode arg (default: every declared)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then arguments for every certify run")
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest

    from lora_conformance import devices
    from lora_conformance.engines.registry import engine_class

    declared = engine_class(a.engine).exec_modes(devices.device_type(a.device))
    if not declared:
        print(f"engine {a.engine!r} declares no execution modes on {a.device}: nothing to combine")
        return 2
    (key, values), = declared.items()
    values = tuple(a.modes.split(",")) if a.modes else values
    unknown = set(values) - set(declared[key])
    if unknown:
        print(f"--modes {sorted(unknown)}: not declared by {a.engine} on {a.device} (declared: {declared[key]})")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    runs, per_mode = [], {}
    for value in values:
        report_dir = a.out / value
        cmd = [a.python, "-m", "lora_conformance", "certify", "--engine", a.engine, "--device", a.device,
               "--engine-arg", f"{key}={value}", "--report", str(report_dir)]
        if a.dtype:
            cmd += ["--dtype", a.dtype]
        if rest:
            cmd += ["--"] + rest if "--" not in rest else rest
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        seconds = round(time.perf_counter() - t0, 1)
        report = report_dir / "report.json"
        runs.append({"mode": f"{key}={value}", "exit_code": rc, "seconds": seconds, "report": str(report)})
        print(f"{key}={value}: exit {rc}, {seconds} s", flush=True)
        if report.is_file():
            per_mode[f"{key}={value}"] = feature_statuses(report)
    combined = combine(per_mode)
    certified = all(r["exit_code"] == 0 for r in runs) and len(per_mode) == len(values) and all(
        f["status"] in ("passed", "not certified", "skipped", "xfail") for f in combined.values())
    summary = {"engine": a.engine, "device": a.device, "modes_ran": list(per_mode), "runs": runs,
               "certified_in_every_mode": certified, "features": combined}
    (a.out / "modes.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# {a.engine} on {a.device}: every declared execution mode", "",
             f"Modes that ran: {', '.join(per_mode) or 'none'}. Certified in every mode: "
             f"{'yes' if certified else 'no'}.", "", "| run | exit | seconds |", "|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['exit_code']} | {r['seconds']} |" for r in runs]
    lines += ["", "| feature | " + " | ".join(per_mode) + " | combined |", "|---|" + "---|" * (len(per_mode) + 1)]
    for fid, f in combined.items():
        lines.append(f"| `{fid}` | " + " | ".join(f["modes"][m] for m in per_mode) + f" | {f['status']} |")
    (a.out / "modes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8 + len(runs)]))
    return 0 if certified else 1


if __name__ == "__main__":
    sys.exit(main())
