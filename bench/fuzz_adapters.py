"""Fuzz engines with malformed adapter directories (hypothesis mutations of a valid adapter) and
print, per engine, how many inputs were tried, refused cleanly, accepted, damaged the engine's
state, and raised an untyped error. The bar: 0 damaged, 0 untyped.

    python bench/fuzz_adapters.py [--engines builtin,peft] [--budget 500] [--seed 0] [--device cpu]

The engine holds adapter A; each input is loaded as F (see lora_conformance/adapters/fuzz.py):
refused = a typed EngineError and the engine unchanged; accepted = loaded (then served beside
the base, unloaded) and the engine unchanged; damaged = the adapter list or any output of the
base or A changed (bit-exact); untyped = any other exception, or EngineFailure. Exit code 1 when
anything was damaged or untyped.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.adapters.fuzz import OUTCOMES, apply_mutations, mutations, try_input
from lora_conformance.engine_health import snapshot
from lora_conformance.engines import create_engine
from lora_conformance.models import resolve_base_model
from lora_conformance.settings import default_cache_dir


def fuzz_engine(name, model, good, device, budget, seed_value):
    engine = create_engine(name, model, device, "float32", {})
    engine.load_adapter("A", good)
    before = snapshot(engine, prompts=["the old man"], max_new_tokens=3)
    counts = collections.Counter()
    examples = collections.defaultdict(list)

    @seed(seed_value)
    @settings(max_examples=budget, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(ops=mutations())
    def one(ops):
        with tempfile.TemporaryDirectory() as tmp:
            outcome, detail = try_input(engine, before, apply_mutations(good, Path(tmp) / "f", ops))
        counts[outcome] += 1
        if outcome in ("damaged", "untyped") and len(examples[outcome]) < 5:
            examples[outcome].append((ops, detail))

    t0 = time.monotonic()
    one()
    engine.close()
    return counts, examples, time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="builtin,peft")
    ap.add_argument("--budget", type=int, default=500, help="inputs per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    cache = default_cache_dir()
    model = resolve_base_model("synthetic:llama", cache / "models")
    good = synthesize_cached(model, AdapterSpec(seed=4), cache / "adapters")
    rows = []
    for name in args.engines.split(","):
        counts, examples, took = fuzz_engine(name, model, good, args.device, args.budget, args.seed)
        rows.append((name, counts, took))
        for outcome, items in examples.items():
            for ops, detail in items:
                print(f"[{name}] {outcome}: {ops}\n    {detail[:300]}")
    print(f"\nfuzz_adapters: budget {args.budget} per engine, seed {args.seed}, synthetic:llama, {args.device}, float32")
    print(f"{'engine':<10}{'tried':>7}" + "".join(f"{o:>10}" for o in OUTCOMES) + f"{'seconds':>10}")
    for name, counts, took in rows:
        print(f"{name:<10}{sum(counts.values()):>7}" + "".join(f"{counts[o]:>10}" for o in OUTCOMES)
              + f"{took:>10.0f}")
    bad = sum(c["damaged"] + c["untyped"] for _, c, _ in rows)
    print("0 damaged, 0 untyped: met" if not bad else f"{bad} input(s) damaged an engine or raised untyped errors")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
