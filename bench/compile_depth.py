"""How the built-in engine's compile time grows with the decoder's depth, with dynamo's duck sizing on
(what exec_mode=compile uses) and off (what it used for a while: the full profile's 28-layer compile
case then no longer finished on an H100).

    python bench/compile_depth.py                      # layers 4, 8, 16 on cpu, float32
    python bench/compile_depth.py --layers 8,16,28 --device cuda --dtype bfloat16
    python bench/compile_depth.py --layers 16 --forced-break   # the step broken inside the LoRA routing

Each (depth, setting) runs in a fresh process with an empty inductor cache, serves a batch of 8 rows
(the first compile) and then batches of 3, 12 and 2 (other buckets: no compile expected), and prints
the first batch's seconds, the rest's (recompiles show there) and dynamo's graph count; the table puts
both settings side by side with their ratio. --forced-break breaks the step's graph where torch 2.11
broke it (before the LoRA routing): the engine then compiles it in pieces. The bases are synthetic Qwen2-style decoders (q/k/v biases) of the given depth, built
once into the lora cache. Outputs are not compared (the suites do that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "the cat sat on the mat and the dog"
BATCHES = (8, 3, 12, 2)


def _base(layers: int, cache: Path) -> Path:
    from lora_conformance.models.synthetic import DecoderRecipe, build_decoder

    out = cache / "bench-compile-depth" / f"qwen2-{layers}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        build_decoder(DecoderRecipe(layers=layers, arch="qwen2", tied=True, qkv_bias_std=0.1), tmp)
        tmp.rename(out)
    return out


def _child(args) -> int:
    """One process: the engine in compile mode on ``args.base``, the batches, one JSON line."""
    import torch
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as fx_config

    from lora_conformance.engines.builtin import BuiltinEngine
    from lora_conformance.types import GenerationRequest

    if args.forced_break:
        import torch._dynamo

        from lora_conformance.engines.builtin.engine import model_runner

        real = model_runner.ModelRunner.lora_batch

        def broken(self, *a, **k):
            torch._dynamo.graph_break()
            return real(self, *a, **k)

        model_runner.ModelRunner.lora_batch = broken
    seconds = []
    with BuiltinEngine(Path(args.base), args.device, args.dtype, {"exec_mode": "compile"}) as engine:
        for n in BATCHES:
            reqs = [GenerationRequest(PROMPT, None, max_new_tokens=3, top_k=3) for _ in range(n)]
            start = time.perf_counter()
            if args.duck == "off":  # as every compiled call ran before: the patch around the call
                with fx_config.patch(use_duck_shape=False):
                    engine.generate(reqs)
            else:
                engine.generate(reqs)
            if args.device != "cpu":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds, "graphs": counters["stats"].get("unique_graphs", 0)}), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,8,16", help="comma-separated depths")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache", default=None, help="lora cache directory (default: the plugin's)")
    ap.add_argument("--forced-break", action="store_true", help="break the step's graph before the LoRA routing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--duck", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    from lora_conformance.settings import default_cache_dir

    try:
        depths = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--layers {args.layers!r}: expected comma-separated integers")
    if not depths or min(depths) < 1:
        ap.error(f"--layers {args.layers!r}: expected positive depths")
    cache = Path(args.cache) if args.cache else default_cache_dir()
    rows = []
    for layers in depths:
        base = _base(layers, cache)
        row = {}
        for duck in ("on", "off"):
            with tempfile.TemporaryDirectory(prefix="inductor-") as fresh:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=fresh)
                proc = subprocess.run([sys.executable, __file__, "--child", "--base", str(base), "--duck", duck,
                                       "--device", args.device, "--dtype", args.dtype]
                                      + (["--forced-break"] if args.forced_break else []),
                                      env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                print(f"layers {layers}, duck sizing {duck}: the child failed (rc {proc.returncode})\n"
                      f"{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            row[duck] = json.loads(lines[-1])
            print(f"layers {layers:3}, duck sizing {duck:3}: first batch {row[duck]['seconds'][0]:7.1f} s, "
                  f"the rest {sum(row[duck]['seconds'][1:]):5.1f} s, graphs {row[duck]['graphs']}", flush=True)
        rows.append((layers, row))
    broken = ", the step's graph broken before the LoRA routing" if args.forced_break else ""
    print(f"\nexec_mode=compile on {args.device}, {args.dtype}{broken}: seconds of the first batch (the compile) "
          f"and of all four batches")
    print(f"{'layers':>6} {'first on':>9} {'off':>7} {'off/on':>7} {'all on':>7} {'off':>7} {'off/on':>7} {'graphs on/off':>14}")
    for layers, row in rows:
        on, off = row["on"]["seconds"][0], row["off"]["seconds"][0]
        all_on, all_off = sum(row["on"]["seconds"]), sum(row["off"]["seconds"])
        print(f"{layers:6} {on:9.1f} {off:7.1f} {off / on:7.2f} {all_on:7.1f} {all_off:7.1f} {all_off / all_on:7.2f} "
              f"{row['on']['graphs']:>8}/{row['off']['graphs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
