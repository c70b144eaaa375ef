"""Where an execution mode's time goes: the built-in engine serves the batches of
suites/test_runtime_modes.py's ``test_each_exec_mode_matches_reference`` (sizes 8, 8, 5, 3, 12, 1, 2,
three adapters and base rows, the suite's requests: its prompts, 16 new tokens, top 5) once per mode,
the modes side by side, with each batch's seconds and, for compile, how many graphs dynamo compiled.

    python bench/exec_mode_batches.py --device cuda --dtype bfloat16 --profile full
    python bench/exec_mode_batches.py --device cpu --modes eager,compile       # compile: forced on cpu

On the H200 that case took 284 s in compile mode at the full profile (eager 9 s, graphs 4 s); this script
on an H100 showed why (reports/2026-12-06-h100-compile-mode-and-detection/): the step broke its graph
under torch 2.11 and the resumed frame compiled again for three buckets, on guards duck sizing added
(bench/compile_depth.py: why duck sizing stays on all the same).
Each batch is printed as it ends; with ``TORCH_LOGS=recompiles`` dynamo says why it compiled again.
The default modes are those the engine declares on the device; outputs are not compared (the suite
does that).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from lora_conformance.models import profiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", default="fast", choices=sorted(profiles.PROFILES))
    ap.add_argument("--modes", default=None, help="comma-separated exec_mode values (default: the declared ones)")
    ap.add_argument("--cache", default=None, help="lora cache directory (default: the plugin's)")
    args = ap.parse_args(argv)

    import torch
    from torch._dynamo.utils import counters

    from lora_conformance.adapters import AdapterSpec
    from lora_conformance.adapters.synth import synthesize_adapter
    from lora_conformance.engines.builtin import BuiltinEngine
    from lora_conformance.models import default_prompts, resolve_base_model
    from lora_conformance.settings import default_cache_dir
    from lora_conformance.types import GenerationRequest
    from suites.test_runtime_modes import MODE_BATCHES

    cache = Path(args.cache) if args.cache else default_cache_dir()
    base = resolve_base_model(profiles.get(args.profile).models["decoder"], cache / "models")  # as the plugin keeps it
    adapters = {}
    for i, name in enumerate("ABC"):
        out = cache / "bench-exec-modes" / f"{base.name}-{name}"
        adapters[name] = out if (out / "adapter_config.json").is_file() else synthesize_adapter(
            base, AdapterSpec(seed=310 + i), out)
    modes = args.modes.split(",") if args.modes else list(BuiltinEngine.exec_modes(args.device.split(":")[0])["exec_mode"])
    prompts = default_prompts()
    rows = []
    for mode in modes:
        torch._dynamo.reset()
        counters.clear()
        start = time.perf_counter()
        with BuiltinEngine(base, args.device, args.dtype, {"exec_mode": mode}) as engine:
            started = time.perf_counter() - start
            for name, path in adapters.items():
                engine.load_adapter(name, path)
            seconds = []
            for labels in MODE_BATCHES:
                reqs = [GenerationRequest(prompt=prompts[i % len(prompts)], adapter=a, max_new_tokens=16, top_k=5)
                        for i, a in enumerate(labels)]
                t = time.perf_counter()
                engine.generate(reqs)
                seconds.append(time.perf_counter() - t)
                # as it goes: a run cut by a time limit still says where its time went
                print(f"{mode}: batch of {len(reqs)} in {seconds[-1]:.1f} s, dynamo graphs so far "
                      f"{counters['stats'].get('unique_graphs', 0)}", flush=True)
        graphs = counters["stats"].get("unique_graphs", 0)
        rows.append((mode, started, seconds, graphs))
        print(f"{mode}: engine start {started:.1f} s, batches {sum(seconds):.1f} s, dynamo graphs {graphs}", flush=True)
    sizes = [len(b) for b in MODE_BATCHES]
    print(f"\n{profiles.get(args.profile).models['decoder']} on {args.device}, {args.dtype}: seconds per batch (rows)")
    print(f"{'mode':8} {'start':>6} " + " ".join(f"{s:>6}" for s in sizes) + f" {'total':>7} {'x eager':>7} graphs")
    eager = next((sum(s) for m, _, s, _ in rows if m == "eager"), None)
    for mode, started, seconds, graphs in rows:
        ratio = f"{sum(seconds) / eager:7.1f}" if eager else "      -"
        print(f"{mode:8} {started:6.1f} " + " ".join(f"{s:6.1f}" for s in seconds) + f" {sum(seconds):7.1f} {ratio} {graphs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
