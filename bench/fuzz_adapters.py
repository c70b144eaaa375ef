"""Fuzz engines with malformed adapter directories (hypothesis mutations of a valid adapter) and
print, per engine, how many inputs were tried, refused cleanly, accepted, damaged the engine's
state, and raised an untyped error. The bar: 0 damaged, 0 untyped.

    python bench/fuzz_adapters.py [--engines builtin,peft] [--budget 500] [--seed 0] [--device cpu] [--agree 40]

The engine holds adapter A; each input is loaded as F (see lora_conformance/adapters/fuzz.py):
refused = a typed EngineError and the engine unchanged; accepted = loaded (then served beside
the base, unloaded) and the engine unchanged; damaged = the adapter list or any output of the
base or A changed (bit-exact); untyped = any other exception, or EngineFailure. Exit code 1 when
anything was damaged or untyped.

Agreement (``--agree N``): up to N of the inputs the first engine accepted are loaded again into
the builtin and peft engines and run against the reference (HF transformers + PEFT); each must
be refused by both engines alike, or served by both within the float32 tolerance of the
reference (``compare.assert_logprobs_close``). Exit code 1 on any disagreement too.
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
from lora_conformance.judge.health import snapshot
from lora_conformance.engines import create_engine
from lora_conformance.models import resolve_base_model
from lora_conformance.settings import default_cache_dir


def fuzz_engine(name, model, good, device, budget, seed_value):
    engine = create_engine(name, model, device, "float32", {})
    engine.load_adapter("A", good)
    before = snapshot(engine, prompts=["the old man"], max_new_tokens=3)
    counts = collections.Counter()
    examples = collections.defaultdict(list)
    accepted = []

    @seed(seed_value)
    @settings(max_examples=budget, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(ops=mutations())
    def one(ops):
        with tempfile.TemporaryDirectory() as tmp:
            outcome, detail = try_input(engine, before, apply_mutations(good, Path(tmp) / "f", ops))
        counts[outcome] += 1
        if sum(counts.values()) % 50 == 0:  # progress, so a long run that is cut short still says something
            print(f"[{name}] {sum(counts.values())} tried: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES),
                  flush=True)
        if outcome in ("damaged", "untyped") and len(examples[outcome]) < 5:
            examples[outcome].append((ops, detail))
        if outcome == "accepted":
            accepted.append(ops)

    t0 = time.monotonic()
    one()
    engine.close()
    return counts, examples, time.monotonic() - t0, accepted


def agreement(model, good, accepted, device, limit):
    """(counts, examples): each accepted input refused by builtin and peft alike, or served by both
    within the float32 tolerance of the reference."""
    from lora_conformance.judge import assert_logprobs_close
    from lora_conformance.engines import EngineError
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    engines = {name: create_engine(name, model, device, "float32", {}) for name in ("builtin", "peft")}
    reference = ReferenceRunner(model, "cpu", "float32", None)
    counts, examples = collections.Counter(), []
    reqs = [GenerationRequest("the old man", "F", 6), GenerationRequest("a cat sat on the", "F", 6)]
    seen = set()
    for ops in accepted:
        if len(seen) >= limit or repr(ops) in seen:
            continue
        seen.add(repr(ops))
        with tempfile.TemporaryDirectory() as tmp:
            d = apply_mutations(good, Path(tmp) / "f", ops)
            loaded = {}
            for name, e in engines.items():
                try:
                    e.load_adapter("F", d)
                    loaded[name] = True
                except EngineError as exc:
                    loaded[name] = f"{type(exc).__name__}: {exc}"
            try:
                if not any(v is True for v in loaded.values()):
                    counts["refused by both"] += 1
                    continue
                if not all(v is True for v in loaded.values()):
                    counts["disagree"] += 1
                    examples.append((ops, f"loaded: {loaded}"))
                    continue
                expected = reference.generate(reqs, {"F": d})
                for name, e in engines.items():
                    for got, want in zip(e.generate(reqs), expected):
                        assert_logprobs_close(got, want, "float32", label=name)
                counts["agree"] += 1
            except Exception as exc:  # noqa: BLE001 - a disagreement (or an engine that cannot serve it)
                counts["disagree"] += 1
                examples.append((ops, f"{type(exc).__name__}: {str(exc)[:300]}"))
            finally:
                for e in engines.values():
                    if "F" in e.list_adapters():
                        e.unload_adapter("F")
    for e in engines.values():
        e.close()
    return counts, examples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="builtin,peft")
    ap.add_argument("--budget", type=int, default=500, help="inputs per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--agree", type=int, default=40,
                    help="accepted inputs checked for builtin/peft/reference agreement (0: none)")
    args = ap.parse_args(argv)
    cache = default_cache_dir()
    model = resolve_base_model("synthetic:llama", cache / "models")
    good = synthesize_cached(model, AdapterSpec(seed=4), cache / "adapters")
    rows, first_accepted = [], None
    for name in args.engines.split(","):
        counts, examples, took, accepted = fuzz_engine(name, model, good, args.device, args.budget, args.seed)
        first_accepted = accepted if first_accepted is None else first_accepted
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
    if args.agree and first_accepted:
        agree, disagreements = agreement(model, good, first_accepted, args.device, args.agree)
        for ops, detail in disagreements[:5]:
            print(f"[agreement] disagree: {ops}\n    {detail}")
        print(f"agreement on accepted inputs (builtin, peft vs reference, float32): "
              + ", ".join(f"{k} {v}" for k, v in sorted(agree.items())))
        bad += agree["disagree"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
