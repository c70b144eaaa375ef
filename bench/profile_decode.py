"""Where the built-in engine's time goes on the throughput workload (bench/engine_throughput.py).

For builtin-mixed and builtin-base, one instrumented generate() after a warm-up:
  * wall time of the whole call, of prefill and of the decode steps;
  * device-busy time of each decode step (device events around the step's launches: with graphs,
    the replay), so that wall - busy is what the host costs per step;
  * with ``--kernels``: the device kernels of one eager decode step (torch.profiler), grouped by
    name, with their count and total device time.

  python bench/profile_decode.py --config gpu --device cuda --kernels
  python bench/profile_decode.py --config cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import CONFIGS, build_world, builtin_requests, make_builtin, routing  # noqa: E402


def breakdown(eng, c, names, device) -> dict:
    """One generate() with per-phase wall times and per-decode-step device-busy times."""
    from lora_conformance import devices

    runner = eng.runner
    timing = {"prefill": [], "decode": [], "busy": []}
    accel = devices.device_type(device) != "cpu"
    orig_prefill, orig_decode = runner.prefill, runner.decode

    def prefill(seqs):
        devices.synchronize(device)
        t = time.perf_counter()
        out = orig_prefill(seqs)
        timing["prefill"].append(time.perf_counter() - t)
        return out

    def decode(seqs):
        t = time.perf_counter()
        if accel:
            mod = devices.device_module(device)
            ev0, ev1 = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            ev0.record(devices.current_stream(device))
        out = orig_decode(seqs)  # ends with the device->host copy of the step's tokens: synchronised
        if accel:
            ev1.record(devices.current_stream(device))
            ev1.synchronize()
            timing["busy"].append(ev0.elapsed_time(ev1) / 1e3)
        timing["decode"].append(time.perf_counter() - t)
        return out

    eng.generate(builtin_requests(c, names, 1))  # warm-up: slots, graphs, allocator
    devices.synchronize(device)
    t = time.perf_counter()
    eng.generate(builtin_requests(c, names, 2))
    devices.synchronize(device)
    plain = time.perf_counter() - t
    runner.prefill, runner.decode = prefill, decode
    try:
        devices.synchronize(device)
        t = time.perf_counter()
        eng.generate(builtin_requests(c, names, 2))
        devices.synchronize(device)
        total = time.perf_counter() - t
    finally:
        runner.prefill, runner.decode = orig_prefill, orig_decode
    steps = timing["decode"]
    out = {"plain_s": plain, "total_s": total, "prefill_s": sum(timing["prefill"]), "decode_s": sum(steps),
           "steps": len(steps), "step_ms_median": 1e3 * statistics.median(steps)}
    if timing["busy"]:
        out["busy_ms_median"] = 1e3 * statistics.median(timing["busy"])
        out["host_ms_median"] = out["step_ms_median"] - out["busy_ms_median"]
    out["other_s"] = total - out["prefill_s"] - out["decode_s"]
    return out


def kernels(eng, c, names, device, phase: str = "decode") -> list[tuple[str, int, float]]:
    """(kernel name, count, total device ms) over one eager decode step (or the prefill)."""
    from torch.profiler import ProfilerActivity, profile

    runner, seen = eng.runner, []
    attr = "decode_forward" if phase == "decode" else "prefill"
    orig = getattr(runner, attr)

    def traced(*a, **kw):
        if seen:
            return orig(*a, **kw)
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        with profile(activities=acts) as prof:
            out = orig(*a, **kw)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        seen.append(prof)
        return out

    setattr(runner, attr, traced)
    try:
        eng.generate(builtin_requests(c, names, 3, new=2))
    finally:
        setattr(runner, attr, orig)
    rows = {}
    for e in seen[0].events():
        dt = getattr(e, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        name = e.name[:90]
        n, ms = rows.get(name, (0, 0.0))
        rows[name] = (n + 1, ms + e.time_range.elapsed_us() / 1e3)
    return sorted(((k, n, ms) for k, (n, ms) in rows.items()), key=lambda r: -r[2])


def host_profile(eng, c, names, top: int) -> None:
    """cProfile of one generate(): where the host's time goes (launch-bound phases show as torch calls)."""
    import cProfile
    import io
    import pstats

    eng.generate(builtin_requests(c, names, 1))
    reqs = builtin_requests(c, names, 2)
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(reqs)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print("\n".join("    " + ln for ln in buf.getvalue().splitlines() if ln.strip()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    ap.add_argument("--device", default=None)
    ap.add_argument("--graphs", choices=("auto", "0", "1"), default="auto")
    ap.add_argument("--kernels", action="store_true", help="also profile the kernels of one eager decode step")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--host", action="store_true", help="also cProfile one generate() (host time by function)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode", help="what --kernels profiles")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra built-in engine arg (e.g. kernels=torch), repeatable")
    a = ap.parse_args(argv)
    from lora_conformance import devices

    c = CONFIGS[a.config]
    extra = dict(kv.split("=", 1) for kv in a.engine_arg)
    device = devices.resolve_device(a.device or ("cpu" if a.config == "cpu" else "auto"))
    graphs = devices.graphs_supported(device) if a.graphs == "auto" else a.graphs == "1"
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters, _ = build_world(Path(tmp), c)
        for label, names in (("builtin-mixed", routing(c)), ("builtin-base", [None] * c["batch"])):
            eng = make_builtin(base, adapters, c, device, graphs, extra)
            r = breakdown(eng, c, names, device)
            eng.close()
            tok = c["batch"] * c["new"]
            line = (f"{label:14s} graphs={graphs} {' '.join(a.engine_arg)} plain {r['plain_s']:.4f} s ({tok / r['plain_s']:.0f} tok/s) | "
                    f"instrumented {r['total_s']:.4f} s: prefill {1e3 * r['prefill_s']:.1f} ms, "
                    f"{r['steps']} decode steps {1e3 * r['decode_s']:.1f} ms (median {r['step_ms_median']:.3f} ms")
            if "busy_ms_median" in r:
                line += f", device busy {r['busy_ms_median']:.3f} ms, host {r['host_ms_median']:.3f} ms"
            line += f"), other {1e3 * r['other_s']:.1f} ms"
            print(line, flush=True)
            if a.host:
                eng = make_builtin(base, adapters, c, device, graphs, extra)
                host_profile(eng, c, names, a.top)
                eng.close()
            if a.kernels and devices.device_type(device) == "cuda":
                eng = make_builtin(base, adapters, c, device, False, extra)
                ks = kernels(eng, c, names, device, a.phase)
                eng.close()
                tot_n, tot_ms = sum(n for _, n, _ in ks), sum(ms for _, _, ms in ks)
                print(f"  eager {a.phase}: {tot_n} kernel launches, {tot_ms:.3f} ms device; top {a.top}:")
                for name, n, ms in ks[: a.top]:
                    print(f"    {n:5d} {ms:8.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
