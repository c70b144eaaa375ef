"""Null distribution and power of the paired effect verdict, per test family and dtype.

Null runs: correct engines with benign variations, each run randomised (adapter seed and rank,
prompt subset, row order, composition), judged exactly as the suites judge them
(``conformance.run`` + ``compare.effects`` + the free-running decode check). Variations:
``default``; ``rescale:C`` (adapter stored as C*A, B/C: the same delta, other rounding);
``preround`` (A and B rounded to the model dtype first); ``reverse`` (each engine call's requests
in reversed order); ``one_at_a_time`` (each request alone); ``peft`` (the PEFT engine); and any
``--engine-arg`` set of the built-in engine given with ``--variant`` (e.g. ``variant=fp32_delta``).
Any failure of a null run is a false alarm.

Power: the same runs with the engine's delta mis-scaled (B x s stored in the adapter the engine
loads, the reference keeps the original) for each s of ``--scales``; the smallest |s - 1| detected
in every run is printed per family and dtype, with the detection rate.

    python bench/power.py --dtypes float32,bfloat16,float16 --runs 200 --power-runs 20
    python bench/power.py --device cuda --dtypes bfloat16 --runs 200        # on an accelerator
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

from lora_conformance import conformance
from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.compare import tolerance_for
from lora_conformance.compare.effects import SuiteDefectError
from lora_conformance.compare.logprobs import assert_logprobs_close
from lora_conformance.compare.errors import ConformanceAssertionError
from lora_conformance.engines import create_engine
from lora_conformance.models import default_prompts, resolve_base_model
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.settings import default_cache_dir
from lora_conformance.types import GenerationRequest

SEEDS = (9, 19, 33, 37, 101, 202, 303, 404)
FAMILIES = {
    # one q/v adapter per request (accuracy::single_adapter_matches_reference)
    "accuracy": lambda rng: ([AdapterSpec(seed=rng.choice(SEEDS), rank=rng.choice((8, 16)))], "single"),
    # target sets, rsLoRA, patterns (adapter_semantics)
    "semantics": lambda rng: ([rng.choice([
        AdapterSpec(seed=rng.choice(SEEDS), targets=rng.choice(("attention", "mlp", "all-linear"))),
        AdapterSpec(seed=rng.choice(SEEDS), rank=16, alpha=8, use_rslora=True),
        AdapterSpec(seed=rng.choice(SEEDS), rank=8, alpha=16, rank_pattern={"v_proj": 4},
                    alpha_pattern={"q_proj": 32})])], "single"),
    # every linear module targeted, q/k B 5x, down_proj 2x (adapter_semantics::target_set): the family that certifies
    # single modules, and whose dropped modules the power runs inject
    "alllinear": lambda rng: ([AdapterSpec(seed=rng.choice(SEEDS), targets="all-linear",
                                           b_std_pattern={"q_proj": 0.15, "k_proj": 0.15, "down_proj": 0.06})], "single"),
    # two adapters and base rows in one batch (mixed_batch, accuracy::every_dtype)
    "mixed": lambda rng: ([AdapterSpec(seed=s) for s in rng.sample(SEEDS, 2)], "mixed"),
}
VARIATIONS = ("default", "rescale:3", "rescale:0.25", "preround", "reverse", "one_at_a_time", "peft")


class _Wrapper:
    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):  # limits, capabilities, load_adapter, ...: the wrapped engine's
        return getattr(self.engine, name)


class Reversed(_Wrapper):
    def generate(self, reqs):
        return list(reversed(self.engine.generate(list(reversed(reqs)))))


class OneAtATime(_Wrapper):
    def generate(self, reqs):
        return [self.engine.generate([r])[0] for r in reqs]


def transformed(src: Path, how: str, dtype: str, root: Path) -> Path:
    """A copy of adapter ``src`` with its factors transformed (``rescale:C``, ``preround``, ``scale:S``)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = root / f"{src.name}-{how.replace(':', '_')}-{dtype}"
    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    tensors = load_file(src / "adapter_model.safetensors")
    kind, _, arg = how.partition(":")
    for k, t in tensors.items():
        is_a = "lora_A" in k or "lora_embedding_A" in k
        is_b = "lora_B" in k or "lora_embedding_B" in k
        if kind == "rescale":
            c = float(arg)
            tensors[k] = t * c if is_a else (t / c if is_b else t)
        elif kind == "scale" and is_b:
            tensors[k] = t * float(arg)
        elif kind == "drop" and is_b and f".{arg}." in k:
            tensors[k] = t * 0
        elif kind == "preround" and (is_a or is_b):
            tensors[k] = t.to(getattr(torch, dtype)).to(t.dtype)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def one_run(rng, family, engine, runner, model_dir, cache, dtype, tmp, how=None):
    """One randomised run; returns (passed, stats, message)."""
    specs, shape = FAMILIES[family](rng)
    names = [f"a{i}" for i in range(len(specs))]
    paths = {n: synthesize_cached(model_dir, s, cache / "adapters") for n, s in zip(names, specs)}
    if shape == "single":
        labels = [names[0]] * (16 if family == "alllinear" else 6)
    else:
        labels = names * 2 + [None] * 2
        rng.shuffle(labels)
    prompts = rng.sample(default_prompts(), len(labels))
    loaded = []
    try:
        for n in names:
            p = transformed(paths[n], how, dtype, tmp) if how else paths[n]
            engine.engine.load_adapter(n, p) if hasattr(engine, "engine") else engine.load_adapter(n, p)
            loaded.append(n)
        tol = tolerance_for(dtype)
        alts = conformance.default_alternatives(labels, paths)
        plan = conformance.Plan(labels, prompts, paths, alts,
                                conformance.required_hypotheses(alts, modules=family == "alllinear"))
        analyses = conformance.run(plan, engine, runner, tol)
        stats = {"residual": max(a.residual_rms for a in analyses) / tol.effect_noise_max,
                 "slope": max(abs(a.slope - 1) / (tol.effect_slope_margin + 4 * a.slope_se) for a in analyses),
                 "gamma": max((f.gamma for a in analyses for f in a.fits), default=0.0),
                 "separation": min((f.separation for a in analyses for f in a.fits), default=math.inf),
                 "free_running": 0.0}
        failures = [f"{a.label}: {x}" for a in analyses for x in a.failures]
        defects = [f"{a.label}: {x}" for a in analyses for x in a.defects]
        reqs = [GenerationRequest(p, l, 16, 5) for l, p in zip(labels, prompts)]
        outs = engine.generate(reqs)
        refs = runner.generate(reqs, paths)
        from dataclasses import replace

        gross = replace(tol, decode_atol=max(tol.decode_atol, tol.free_running_atol),
                        tie_margin=max(tol.tie_margin, tol.free_running_atol))
        for o, r, q in zip(outs, refs, reqs):
            try:
                ag = assert_logprobs_close(o, r, gross, label=str(q.adapter))
                stats["free_running"] = max(stats["free_running"], ag.max_decode_diff / gross.decode_atol)
            except ConformanceAssertionError as exc:
                failures.append(f"free-running: {str(exc).splitlines()[0]}")
        return not failures, stats, failures, defects
    finally:
        target = engine.engine if hasattr(engine, "engine") else engine
        for n in loaded:
            target.unload_adapter(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--variations", default=",".join(VARIATIONS))
    ap.add_argument("--variant", action="append", default=[],
                    help="extra built-in engine arg set as a variation, e.g. variant=fp32_delta (repeatable)")
    ap.add_argument("--runs", type=int, default=200, help="null runs per dtype")
    ap.add_argument("--power-runs", type=int, default=10, help="runs per family, dtype and scale")
    ap.add_argument("--scales", default="0.9,0.95,1.03,1.05,1.1")
    ap.add_argument("--drops", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="modules whose LoRA the engine drops in the alllinear family's power runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=default_cache_dir())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", help="print the combined tables of earlier --json outputs")
    a = ap.parse_args()
    if a.merge:
        return merge(a)
    rng = random.Random(a.seed)
    model_dir = resolve_base_model("synthetic:llama", a.cache / "models")
    runner = ReferenceRunner(model_dir, "cpu", "float32", ReferenceCache(a.cache / "references"))
    tmp = Path(tempfile.mkdtemp(prefix="lc-power-"))
    families = a.families.split(",")
    variations = a.variations.split(",") + [f"builtin:{v}" for v in a.variant]
    results = {}
    engines = {}

    def engine_for(var, dtype):
        name = "peft" if var == "peft" else "builtin"
        args = dict(x.split("=", 1) for x in var.split(":", 1)[1].split(",")) if var.startswith("builtin:") else {}
        key = (name, dtype, tuple(sorted(args.items())))
        if key not in engines:
            for k in [k for k in engines if k[1] != dtype]:
                engines.pop(k).close()
            engines[key] = create_engine(name, model_dir, a.device, dtype, args)
        e = engines[key]
        return Reversed(e) if var == "reverse" else OneAtATime(e) if var == "one_at_a_time" else e

    try:
        for dtype in a.dtypes.split(","):
            t0 = time.time()
            null = {f: {"runs": 0, "false_alarms": 0, "defects": 0, "worst": {}} for f in families}
            alarms = []
            for i in range(a.runs):
                fam, var = families[i % len(families)], rng.choice(variations)
                how = var if var.startswith(("rescale", "preround")) else None
                ok, stats, failures, defects = one_run(rng, fam, engine_for(var, dtype), runner, model_dir,
                                                       a.cache, dtype, tmp, how)
                row = null[fam]
                row["runs"] += 1
                row["false_alarms"] += not ok
                row["defects"] += bool(defects)
                for k, v in stats.items():
                    row["worst"][k] = (min if k == "separation" else max)(row["worst"].get(k, v), v)
                if not ok or defects:
                    alarms.append({"family": fam, "variation": var, "failures": failures, "defects": defects})
                if a.json and i % 20 == 19:  # partial results survive a time limit
                    results[dtype] = {"null": null, "alarms": alarms[:20], "power": {}, "seconds": time.time() - t0}
                    a.json.write_text(json.dumps(results, indent=1, default=str))
            power = {}
            for m in [x for x in a.drops.split(",") if x]:
                hits = 0
                for _ in range(a.power_runs):
                    ok, *_ = one_run(rng, "alllinear", engine_for("default", dtype), runner, model_dir, a.cache,
                                     dtype, tmp, f"drop:{m}")
                    hits += not ok
                power.setdefault("drop", {})[m] = [hits, a.power_runs]
                _save_partial(a, results, dtype, null, alarms, power, t0)
            for fam in [f for f in families if f not in ("mixed", "alllinear")]:
                for s in [float(x) for x in a.scales.split(",") if x]:
                    hits = 0
                    for _ in range(a.power_runs):
                        ok, *_ = one_run(rng, fam, engine_for("default", dtype), runner, model_dir, a.cache,
                                         dtype, tmp, f"scale:{s}")
                        hits += not ok
                    power.setdefault(fam, {})[s] = [hits, a.power_runs]
                    _save_partial(a, results, dtype, null, alarms, power, t0)
            results[dtype] = {"null": null, "alarms": alarms[:20], "power": power, "seconds": time.time() - t0}
            if a.json:
                a.json.write_text(json.dumps(results, indent=1, default=str))
            _print(dtype, null, power, alarms, a)
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


def _save_partial(a, results, dtype, null, alarms, power, t0) -> None:
    if a.json:
        results[dtype] = {"null": null, "alarms": alarms[:20], "power": power, "seconds": time.time() - t0}
        a.json.write_text(json.dumps(results, indent=1, default=str))


def merge(a) -> None:
    """Sum null runs and false alarms over several --json files (runs split over processes)."""
    combined: dict = {}
    for path in a.merge:
        for dtype, r in json.loads(path.read_text()).items():
            c = combined.setdefault(dtype, {"null": {}, "alarms": [], "power": {}})
            for fam, row in r["null"].items():
                cr = c["null"].setdefault(fam, {"runs": 0, "false_alarms": 0, "defects": 0, "worst": {}})
                for k in ("runs", "false_alarms", "defects"):
                    cr[k] += row[k]
                for k, v in row["worst"].items():
                    cr["worst"][k] = (min if k == "separation" else max)(cr["worst"].get(k, v), v)
            c["alarms"] += r["alarms"]
            for fam, by in r["power"].items():  # runs of one cell split over processes add up
                cell = c["power"].setdefault(fam, {})
                for k, v in by.items():
                    k = float(k) if fam != "drop" else k
                    h, n = _counts(cell.get(k, [0, 0]))
                    h2, n2 = _counts(v)
                    cell[k] = [h + h2, n + n2]
    for dtype, c in combined.items():
        _print(dtype, c["null"], c["power"], c["alarms"], a)


def _counts(v) -> tuple[int, int]:
    """[hits, runs] of a power cell (older files hold a rate: counted as one run)."""
    if isinstance(v, (list, tuple)):
        return int(v[0]), int(v[1])
    return (1 if v >= 1.0 else 0), 1


def _lower_bound(hits: int, runs: int) -> float:
    """One-sided 95% lower confidence bound on the detection rate when every run detected
    (Clopper-Pearson: 0.05 ** (1 / runs)); 0 otherwise (not claimed)."""
    return 0.05 ** (1 / runs) if runs and hits == runs else 0.0


def _print(dtype, null, power, alarms, a):
    power = dict(power)
    tol = tolerance_for(dtype)
    print(f"\n== {dtype} on {a.device}: effect_noise {tol.effect_noise:g}, noise_max {tol.effect_noise_max:g}, "
          f"slope_margin {tol.effect_slope_margin:g}")
    print(f"{'family':10} {'runs':>5} {'false alarms':>12} {'defects':>8} {'resid/bound':>11} {'slope/bound':>11} "
          f"{'max gamma':>9} {'min separ.':>10} {'free-run/atol':>13}")
    for fam, r in null.items():
        w = r["worst"]
        print(f"{fam:10} {r['runs']:>5} {r['false_alarms']:>12} {r['defects']:>8} {w.get('residual', 0):>11.3f} "
              f"{w.get('slope', 0):>11.3f} {w.get('gamma', 0):>9.3f} {w.get('separation', 0):>10.1f} "
              f"{w.get('free_running', 0):>13.3f}")
    total = sum(r["runs"] for r in null.values())
    fa = sum(r["false_alarms"] for r in null.values())
    print(f"false alarms: {fa}/{total} runs (95% upper bound on the per-run rate: {3 / max(total, 1):.3g} when 0)")
    for al in alarms[:5]:
        print("  alarm:", al["family"], al["variation"], (al["failures"] + al["defects"])[:2])
    drops = power.pop("drop", {})
    if drops:
        print("single module dropped, detected: " + "  ".join(
            f"{m}: {h}/{n}" for m, (h, n) in ((m, _counts(v)) for m, v in drops.items())))
    for fam, by_scale in power.items():
        counts = {float(s): _counts(v) for s, v in by_scale.items()}
        cells = "  ".join(f"x{s:g}: {h}/{n}" for s, (h, n) in sorted(counts.items()))
        detected = [(abs(s - 1), n) for s, (h, n) in counts.items() if n and h == n]
        if detected:
            m, n = min(detected)
            runs = min(n for d, n in detected if d == m)
            print(f"power {fam:10} {cells}   smallest mis-scale detected in every run: {m:.0%} "
                  f"({runs}/{runs}: power >= {_lower_bound(runs, runs):.1%} at 95% confidence)")
        else:
            print(f"power {fam:10} {cells}   none detected in every run")


if __name__ == "__main__":
    main()
