"""Does a process that builds and closes the built-in engine again and again keep growing? Each run
builds the engine on the profile's decoder, loads three new adapters (a new draw every run, as
bench/power.py's runs do), serves a mixed batch, closes the engine and hands freed pages back
(parallel.release_freed_memory); with --reference the HF + PEFT reference then serves the same batch
(one runner over all runs, as a worker keeps it). Prints the process's anonymous resident memory
after each step, and the growth from the first run to the last.

    python bench/engine_memory_growth.py --profile full --runs 10 --reference
    python bench/engine_memory_growth.py --runs 20                  # the fast profile's decoder

Linux (/proc/self/status; elsewhere bench/power.py's reading falls back to the peak so far).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def anon_gb() -> float:
    """The anonymous part of this process's resident memory (bench/power.py's reading), GB."""
    from power import resident_gb  # bench/ is on the path of a script run from it

    return resident_gb()[1]


def main(argv=None) -> int:
    from lora_conformance.models import profiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="fast", choices=sorted(profiles.PROFILES))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reference", action="store_true", help="also serve each batch by the reference")
    ap.add_argument("--cache", default=None, help="lora cache directory (default: the plugin's)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: expected at least 1")

    from lora_conformance.adapters import AdapterSpec, synthesize_cached
    from lora_conformance.engines.builtin import BuiltinEngine
    from lora_conformance.models import default_prompts, resolve_base_model
    from lora_conformance.parallel import release_freed_memory
    from lora_conformance.reference.runner import ReferenceRunner
    from lora_conformance.settings import default_cache_dir
    from lora_conformance.types import GenerationRequest

    cache = Path(args.cache) if args.cache else default_cache_dir()
    base = resolve_base_model(profiles.get(args.profile).models["decoder"], cache / "models")
    runner = ReferenceRunner(base, "cpu", "float32") if args.reference else None
    prompts = default_prompts()
    print(f"{base.name}, {args.dtype}, {args.runs} runs{' with the reference' if runner else ''}; "
          f"anonymous resident GB at the start {anon_gb():.3f}", flush=True)
    after = []
    for run in range(args.runs):
        start = time.perf_counter()
        specs = [AdapterSpec(targets="all-linear" if k == 0 else "qv", rank=(8, 64, 16)[k], seed=1000 + 3 * run + k)
                 for k in range(3)]
        paths = {f"a{k}": synthesize_cached(base, s, cache / "adapters") for k, s in enumerate(specs)}
        reqs = [GenerationRequest(prompts[j % len(prompts)], f"a{j % 3}" if j < 5 else None, 4) for j in range(6)]
        engine = BuiltinEngine(base, "cpu", args.dtype, {})
        for name, path in paths.items():
            engine.load_adapter(name, path)
        engine.generate(reqs)
        engine.close()
        del engine
        release_freed_memory()
        now = anon_gb()
        line = f"run {run + 1:3}: {time.perf_counter() - start:6.1f} s, after the engine {now:7.3f} GB"
        if runner is not None:
            runner.generate(reqs, paths)
            release_freed_memory()
            now = anon_gb()
            line += f", after the reference {now:7.3f} GB"
        after.append(now)
        print(line, flush=True)
    if len(after) > 1:
        print(f"growth from run 1 to run {len(after)}: {after[-1] - after[0]:+.3f} GB "
              f"({(after[-1] - after[0]) / (len(after) - 1) * 1000:+.1f} MB a run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
