"""Null distribution and power of the paired effect verdicts, per check, test family and dtype.

Null runs: correct engines with benign rewritings, each run randomised (adapter seed and rank,
prompt subset, row order, composition), judged exactly as the suites judge them: every check of
``CHECKS`` is measured on every run (``effects``: ``paired.run``, teacher-forced contexts; ``prompt``:
``paired.run_prompt_logprobs``, the paired prompt-logprob verdict of
``accuracy::prefill_logprobs_with_adapter``; ``free_running``: the decode at the gross bounds; ...), and
a family is judged by the checks the suites apply to its adapters (``APPLIED``); the others are shown
apart as "not applied", never counted. Rewritings, each
the same adapter in exact arithmetic, fed to a correct engine (the reference keeps the original):
``rescale:C`` (C*A, B/C); ``fold:A`` / ``fold:B`` (each module's scaling folded into A or B, alpha set
so the scaling is 1); ``svd`` (A and B rebuilt from an SVD of B @ A, per expert for MoE experts);
``permute`` (rank components permuted); ``pad:P`` (rank padded with P zero components, alpha kept
per module); ``preround`` (A and B rounded to the model dtype); ``merged`` (the LoRA merged into
the base weights, in float32 then rounded to the dtype, for batches of a single adapter); the
engine variations ``reverse`` (each call's requests reversed), ``one_at_a_time`` (each request alone),
``peft`` (the PEFT engine), and any built-in engine-arg set given with ``--variant`` (e.g.
``variant=fp32_delta``). Runs cycle through families and variations, so every family meets every
variation. A failure of an applied check in a null run is a false alarm of that check.

Power: the same runs with the engine's delta mis-scaled (B x s stored in the adapter the engine
loads, the reference keeps the original) for each s of ``--scales``; each module's LoRA dropped
(``--drops``, all-linear family); and each built-in engine fault of ``--faults`` on the families it
applies to (the MoE expert faults on the ``moe`` family), with the detection rate per cell: a run
detects when a check applied to its family fails, and each cell records which checks failed.

    python bench/power.py --dtypes float32,bfloat16,float16 --runs 200 --power-runs 20
    python bench/power.py --device cuda --dtypes bfloat16 --runs 200        # on an accelerator
    python bench/power.py --dtypes bfloat16 --runs 0 --power-runs 20 --scales "" --drops "" \
        --faults moe_lora_unweighted,moe_lora_weight_of_next_expert,moe_lora_first_expert_only
    python bench/power.py --profile full --device cuda --reference-device cuda --new-tokens 48 \
        --variations default,rescale:3,svd,preround,reverse,peft --dtypes bfloat16 --runs 60

``--base-quant q8_0 --activations int8`` (or q4_k) calibrates the rows for 8-bit activations
(judge/tolerances.py ``ACTIVATIONS``): the bases snapped, the reference HF + PEFT on the snapped
weights, the built-in and PEFT engines reading 8-bit activation blocks in front of the quantised
matmuls, as llama.cpp's CPU kernels do (and ``--variant activations=int8_alt``, another quantiser of
those blocks); ``merged`` does not apply (the LoRA would be merged into the quantised base)::

    python bench/power.py --base-quant q8_0 --activations int8 --families accuracy,semantics,alllinear,mixed,rank \
        --variations default,rescale:3,fold:B,svd,permute,pad:8,preround,reverse,one_at_a_time,peft \
        --variant activations=int8_alt --dtypes float32,float16 --runs 200

``--profile full`` runs every family on that profile's bases (models/profiles.py: the real-shape
decoder and MoE), its ranks in the ``rank`` family, and judges by the tolerance rows of the bases'
scale class (judge/tolerances.py ``scale_of_config``): what calibrates the ``real`` rows.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from lora_conformance.judge import paired
from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance import checkpoints
from lora_conformance.context import TestContext
from lora_conformance.judge import tolerance_for
from lora_conformance.judge.tolerances import same_engine_tolerance_for, scale_of_model
from lora_conformance.judge.logprobs import assert_logprobs_close, assert_prompt_logprobs_close
from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.rouge import assert_rouge_l
from lora_conformance.judge.routing import IndistinctReferencesError, assert_nearest_reference_routing
from lora_conformance.engines import create_engine
from lora_conformance.engines.builtin.engine.adapter import svd_factors
from lora_conformance.models import default_prompts, resolve_base_model
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.settings import default_cache_dir
from lora_conformance.types import GenerationRequest

SEEDS = (9, 19, 33, 37, 101, 202, 303, 404)
PROFILE_RANKS = [(1, 8, 16, 64)]  # the run's profile's ranks (main sets them from --profile)
# The activation scheme of the engines' quantised-base matmuls (main sets it from --base-quant and
# --activations): the tolerance rows widened for it (judge/tolerances.py ACTIVATIONS).
ACTIVATION_SCHEME: list = [None]
# The MoE suite's expert adapters (suites/test_moe.py): down_proj B (PEFT's un-nested
# ``experts.lora_B``) strong enough that an expert LoRA output weighted wrongly shows in bfloat16.
MOE_B_STD = {"experts.lora_B": 0.12}
# family -> (adapter specs for a run, shape, base model)
FAMILIES = {
    # one q/v adapter per request (accuracy::single_adapter_matches_reference, prefill_logprobs_with_adapter)
    "accuracy": lambda rng: ([AdapterSpec(seed=rng.choice(SEEDS), rank=rng.choice((8, 16)))], "single", "llama"),
    # target sets, rsLoRA, patterns (adapter_semantics)
    "semantics": lambda rng: ([rng.choice([
        AdapterSpec(seed=rng.choice(SEEDS), targets=rng.choice(("attention", "mlp", "all-linear"))),
        AdapterSpec(seed=rng.choice(SEEDS), rank=16, alpha=8, use_rslora=True),
        AdapterSpec(seed=rng.choice(SEEDS), rank=8, alpha=16, rank_pattern={"v_proj": 4},
                    alpha_pattern={"q_proj": 32})])], "single", "llama"),
    # every linear module targeted, q B 5x, k B 15x, down_proj 2x (adapter_semantics::target_set): the family that
    # certifies single modules, and whose dropped modules the power runs inject
    "alllinear": lambda rng: ([AdapterSpec(seed=rng.choice(SEEDS), targets="all-linear",
                                           b_std_pattern={"q_proj": 0.15, "k_proj": 0.45, "down_proj": 0.06})],
                              "single", "llama"),
    # two adapters and base rows in one batch (mixed_batch, accuracy::every_dtype)
    "mixed": lambda rng: ([AdapterSpec(seed=s) for s in rng.sample(SEEDS, 2)], "mixed", "llama"),
    # adapter_semantics::rank: a rank of the profile's (1 to 64 fast, 1 to 256 full), alpha 2r
    "rank": lambda rng: ([AdapterSpec(seed=rng.choice(SEEDS), rank=(r := rng.choice(PROFILE_RANKS[0])), alpha=2 * r)],
                         "single", "llama"),
    # MoE expert LoRA (moe::expert_lora_matches_reference)
    "moe": lambda rng: ([AdapterSpec(seed=rng.choice((501, 502) + SEEDS), targets="moe_experts",
                                     b_std_pattern=MOE_B_STD)], "single", "moe"),
}
ROWS = {"alllinear": 16, "moe": 6}  # rows of a single-adapter run (default 6)
REWRITES = ("rescale:3", "rescale:0.25", "fold:A", "fold:B", "svd", "permute", "pad:8", "preround")
VARIATIONS = ("default",) + REWRITES + ("merged", "reverse", "one_at_a_time", "peft")
# effects: the paired verdict at teacher-forced contexts (paired.run, lora.assert_conforms). prompt: the paired
# verdict on prompt logprobs (paired.run_prompt_logprobs, lora.assert_prompt_logprobs_conform). free_running: the
# decode at the gross bounds (free_running_atol), as lora.assert_free_running_matches judges it (its requests ask
# no prompt logprobs). prompt_pooled: the prompt logprobs pooled over the run's requests (prompt_rms_max, each
# point under free_running_atol), as lora.assert_matches_reference judges requests that ask for them.
# decode_default: the free-running decode at the default per-step bounds (decode_atol, tie_margin), as the
# suites that compare an engine's decode with the reference directly judge it (lifecycle, prefix cache, ...).
# routing: the nearest-reference routing assertion of mixed_batch::nearest_reference_routing (one prompt,
# every row a different adapter or none), run on the mixed family. free_running and decode_default include
# the ROUGE-L floor where the decode did not end at a tie, as lora.assert_matches_reference judges them.
# same_engine: up to 4 rows of a run generated alone against the same rows in the run's batch, at the
# same-engine bounds (judge/tolerances.py same_engine_tolerance_for), as the suites compare an engine with itself.
CHECKS = ("effects", "prompt", "free_running", "prompt_pooled", "decode_default", "routing", "same_engine")
# The checks the suites apply to each family's adapters: only these count as a false alarm (null runs) or a
# detection (power runs). Every check is still measured on every run; the others are shown apart, as "not
# applied" (what a suite that applied them would see), never counted.
APPLIED = {
    # The default q/v adapters (A, B): accuracy::single_adapter_matches_reference (effects, free_running),
    # accuracy::prefill_logprobs_with_adapter (prompt), backends::each_declared_backend_matches_reference and
    # chunked_prefill (prompt_pooled: requests with prompt logprobs), lifecycle::load_unload_reload and
    # runtime_modes::each_exec_mode_matches_reference (decode_default), mixed_batch::batch_size_invariance and
    # lifecycle's reload (same_engine).
    "accuracy": ("effects", "prompt", "free_running", "prompt_pooled", "decode_default", "same_engine"),
    # adapter_semantics::rslora, rank_and_alpha_patterns, mixed_batch::different_target_sets_in_one_batch:
    # lora.assert_conforms only. (runtime_modes applies decode_default and same_engine to default-strength
    # all-linear adapters of rank 64 and 16, not to this family's rsLoRA and pattern adapters.)
    "semantics": ("effects", "free_running"),
    # adapter_semantics::target_set[all-linear] and layers_to_transform (the STRONG_MODULES adapters):
    # lora.assert_conforms with module drops as alternatives; no suite judges their decode at default bounds.
    "alllinear": ("effects", "free_running"),
    # Two default adapters and base rows: mixed_batch::composition_matches_isolated_references and
    # accuracy::every_dtype_matches_reference (effects, free_running), nearest_reference_routing (routing),
    # random_compositions and large_batch_matches_isolated_references (decode_default), backends and
    # chunked_prefill (prompt_pooled: A, base and B rows), batch_size_invariance and order_invariance (same_engine).
    "mixed": ("effects", "free_running", "prompt_pooled", "decode_default", "routing", "same_engine"),
    # adapter_semantics::rank (and mixed_ranks_in_one_batch): lora.assert_conforms only.
    "rank": ("effects", "free_running"),
    # moe::expert_lora_matches_reference, expert_lora_mixed_batch: lora.assert_conforms only.
    "moe": ("effects", "free_running"),
}


def judged(family: str, failures: dict) -> tuple[list[str], list[str]]:
    """The checks that failed in one run: those the suites apply to ``family`` (a false alarm or a
    detection), and those they do not (shown apart, never counted)."""
    failed = [c for c in CHECKS if failures.get(c)]
    return [c for c in failed if c in APPLIED[family]], [c for c in failed if c not in APPLIED[family]]


def fault_family(fault: str) -> str:
    """The family a built-in engine fault's power runs use: the MoE expert faults on ``moe``."""
    return "moe" if fault.startswith("moe_") else "accuracy"
# The expert-level faults of the built-in engine's catalogue, run on the moe family.
MOE_FAULTS = ("moe_lora_unweighted", "moe_lora_weight_of_next_expert", "moe_lora_first_expert_only",
              "moe_expert_mismatch", "moe_down_proj_dropped")


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


class Merged(_Wrapper):
    """An engine that merges a LoRA into the base weights for batches of that one adapter (no base
    rows, no other adapter) and serves every other batch unmerged: ``make(name, path)`` gives an
    engine on the merged base model."""

    def __init__(self, engine, make):
        super().__init__(engine)
        self.make, self.paths, self.merged = make, {}, {}

    def load_adapter(self, name, path):
        self.engine.load_adapter(name, path)
        self.paths[name] = path

    def unload_adapter(self, name):
        self.engine.unload_adapter(name)
        self.paths.pop(name, None)

    def generate(self, reqs):
        names = {r.adapter for r in reqs}
        if len(names) != 1 or None in names:
            return self.engine.generate(reqs)
        name = names.pop()
        key = str(self.paths[name])
        if key not in self.merged:
            for e in self.merged.values():
                e.close()
            self.merged = {key: self.make(name, self.paths[name])}
        return self.merged[key].generate([replace(r, adapter=None) for r in reqs])

    def close(self):
        for e in self.merged.values():
            e.close()
        self.merged = {}


def merged_model(model_dir: Path, adapter: Path, root: Path) -> Path:
    """``model_dir`` with ``adapter`` merged into its weights (PEFT's merge, float32), saved beside."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dst = root / f"merged-{model_dir.name}-{adapter.name}"
    if dst.exists():
        return dst
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    tmp = root / (dst.name + ".tmp")
    merged.save_pretrained(tmp)
    for f in model_dir.iterdir():
        if f.is_file() and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def _module_scaling(cfg: dict, module: str) -> tuple[int, float, bool]:
    r, alpha = checkpoints.module_rank_alpha(cfg, module)
    return r, alpha, bool(cfg.get("use_rslora", False))


def _unit_alpha(r: int, rs: bool) -> float:
    """The alpha whose scaling is 1 (checkpoints.scaling_rule's divisor, exact)."""
    return math.sqrt(r) if rs else float(r)


def transformed(src: Path, how: str, dtype: str, root: Path) -> Path:
    """A copy of adapter ``src`` rewritten (``REWRITES``, or ``scale:S`` / ``drop:M`` for power):
    the same adapter in exact arithmetic for every rewrite, another for scale / drop."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = root / f"{src.name}-{how.replace(':', '_')}-{dtype}"
    if dst.exists():
        return dst
    cfg = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    kind, _, arg = how.partition(":")
    pairs: dict[str, dict[str, str]] = {}
    for k in tensors:
        for tag, part in (("lora_A", "A"), ("lora_B", "B"), ("lora_embedding_A", "A"), ("lora_embedding_B", "B")):
            if f".{tag}" in k:
                pairs.setdefault(k.split(f".{tag}")[0], {})[part] = k
    gen = torch.Generator().manual_seed(1234)
    new_cfg = dict(cfg)
    if kind == "pad":  # every module's rank + P; alpha per module so that its scaling is unchanged
        p = int(arg)
        new_cfg["r"] = cfg.get("r", 8) + p
        new_cfg["rank_pattern"] = {k: v + p for k, v in (cfg.get("rank_pattern") or {}).items()}
    if kind in ("fold", "pad"):
        new_cfg["alpha_pattern"] = {}
    for stem, ab in pairs.items():
        if "A" not in ab or "B" not in ab:
            continue
        A, B = tensors[ab["A"]].double(), tensors[ab["B"]].double()
        module = stem.removeprefix("base_model.model.")
        module = module.replace(".base_layer", "")
        E = _experts_of(A, B, cfg)
        r = A.shape[0] // E
        if kind == "rescale":
            A, B = A * float(arg), B / float(arg)
        elif kind == "scale":
            B = B * float(arg)
        elif kind == "drop" and f".{arg}" in stem + ".":
            B = B * 0
        elif kind == "preround":
            A, B = A.to(getattr(torch, dtype)).double(), B.to(getattr(torch, dtype)).double()
        elif kind == "svd":
            A, B = svd_factors(A, B, E)
        elif kind in ("permute", "pad"):
            Ae = A.view(E, r, -1)  # experts: lora_A (r*E, in) grouped by expert, lora_B (out, r*E) by rank
            Be = B.view(B.shape[0], r, E).permute(2, 0, 1) if E > 1 else B.unsqueeze(0)
            outA, outB = [], []
            for e in range(E):
                a, b = Ae[e], Be[e]
                if kind == "permute":
                    perm = torch.randperm(r, generator=gen)
                    a, b = a[perm], b[:, perm]
                else:
                    a = torch.cat([a, a.new_zeros(int(arg), a.shape[1])])
                    b = torch.cat([b, b.new_zeros(b.shape[0], int(arg))], dim=1)
                outA.append(a)
                outB.append(b)
            A = torch.cat(outA)
            B = torch.stack(outB).permute(1, 2, 0).reshape(B.shape[0], -1) if E > 1 else outB[0]
        if kind in ("fold", "pad"):
            rm, am, rs = _module_scaling(cfg, module)
            s_m = am / _unit_alpha(rm, rs)
            if kind == "fold":
                A, B = (A * s_m, B) if arg == "A" else (A, B * s_m)
                new_cfg["alpha_pattern"][module] = _unit_alpha(rm, rs)
            else:
                new_cfg["alpha_pattern"][module] = s_m * _unit_alpha(rm + int(arg), rs)
        tensors[ab["A"]], tensors[ab["B"]] = A.float().contiguous(), B.float().contiguous()
    if kind in ("fold", "pad"):  # the rewrite keeps each module's scaling (fold: 1 x the folded factor)
        for stem in pairs:
            module = stem.removeprefix("base_model.model.").replace(".base_layer", "")
            r0, a0, rs = _module_scaling(cfg, module)
            r1, a1, _ = _module_scaling(new_cfg, module)
            want = 1.0 if kind == "fold" else a0 / _unit_alpha(r0, rs)
            got = a1 / _unit_alpha(r1, rs)
            assert abs(got - want) <= 1e-9 * max(1.0, want), (how, module, want, got)
    tmp = root / (dst.name + ".tmp")
    shutil.copytree(src, tmp)
    (tmp / "adapter_config.json").write_text(json.dumps(new_cfg, indent=1))
    save_file(tensors, tmp / "adapter_model.safetensors")
    tmp.rename(dst)
    return dst


def _experts_of(A, B, cfg) -> int:
    """Experts fused in one factor pair (1 for a plain module): lora_A (r*E, in), lora_B (out, r*E)."""
    if not cfg.get("target_parameters"):
        return 1
    r = int(cfg.get("r", 8))
    return max(1, A.shape[0] // r)


def one_run(rng, family, engine, runner, model_dir, cache, dtype, tmp, how=None, new_tokens=16, engine_for_rank=None):
    """One randomised run, judged by every check; returns (failures by check, stats, defects).
    ``engine_for_rank(rank)``: the engine to use for adapters above ``engine``'s max_rank (the suites
    raise an engine's max_rank arg the same way, context.engine_for_rank)."""
    specs, shape, _ = FAMILIES[family](rng)
    top = max(s.rank for s in specs)
    if engine_for_rank is not None and top > engine.limits.max_rank:
        engine = engine_for_rank(top)
    names = [f"a{i}" for i in range(len(specs))]
    paths = {n: synthesize_cached(model_dir, s, cache / "adapters") for n, s in zip(names, specs)}
    if shape == "single":
        labels = [names[0]] * ROWS.get(family, 6)
    else:
        labels = names * 2 + [None] * 2
        rng.shuffle(labels)
    prompts = rng.sample(default_prompts(), len(labels))
    loaded = []
    failures = {c: [] for c in CHECKS}
    try:
        for n in names:
            engine.load_adapter(n, transformed(paths[n], how, dtype, tmp) if how else paths[n])
            loaded.append(n)
        scale = scale_of_model(model_dir)
        tol = tolerance_for(dtype, scale, ACTIVATION_SCHEME[0])
        alts = paired.default_alternatives(labels, paths)
        plan = paired.Plan(labels, prompts, paths, alts,
                                   paired.required_hypotheses(alts, modules=family == "alllinear"))
        analyses = paired.run(plan, engine, runner, tol)
        stats = {"residual": max(a.residual_rms for a in analyses) / tol.effect_noise_max,
                 "slope": max(abs(a.slope - 1) / (tol.effect_slope_margin + 4 * a.slope_se) for a in analyses),
                 "gamma": max((f.gamma for a in analyses for f in a.fits), default=0.0),
                 "separation": min((f.separation for a in analyses for f in a.fits), default=math.inf),
                 "free_running": 0.0, "prompt_rms": 0.0, "prompt_gross": 0.0}
        failures["effects"] += [f"{a.label}: {x}" for a in analyses for x in a.failures]
        defects = [f"{a.label}: {x}" for a in analyses for x in a.defects]
        prompt_lp = engine.supports("prompt_logprobs")
        if prompt_lp:
            try:
                pa = paired.run_prompt_logprobs(plan, engine, runner, tol)
                failures["prompt"] += [f"{a.label}: {x}" for a in pa for x in a.failures]
                defects += [f"prompt {a.label}: {x}" for a in pa for x in a.defects]
                stats.update({
                    "prompt_residual": max(a.residual_rms for a in pa) / tol.effect_noise_max,
                    "prompt_slope": max(abs(a.slope - 1) / (tol.effect_slope_margin + 4 * a.slope_se) for a in pa),
                    "prompt_gamma": max((f.gamma for a in pa for f in a.fits), default=0.0),
                    "prompt_max": max(a.residual_max for a in pa) / tol.effect_gross_atol})
            except ConformanceAssertionError as exc:
                failures["prompt"].append(str(exc).splitlines()[0])
        reqs = [GenerationRequest(p, l, new_tokens, 5, prompt_logprobs=prompt_lp) for l, p in zip(labels, prompts)]
        outs = engine.generate(reqs)
        refs = runner.generate(reqs, paths)
        gross = replace(tol, decode_atol=max(tol.decode_atol, tol.free_running_atol),
                        tie_margin=max(tol.tie_margin, tol.free_running_atol))
        try:  # pooled over every request, as lora.assert_matches_reference does where they ask prompt logprobs
            rms, worst = assert_prompt_logprobs_close(outs, refs, tol, labels=[str(q.adapter) for q in reqs])
            stats["prompt_rms"], stats["prompt_gross"] = rms / tol.prompt_rms_max, worst / tol.free_running_atol
        except ConformanceAssertionError as exc:
            failures["prompt_pooled"].append(f"prompt logprobs: {str(exc).splitlines()[0]}")
        for o, r, q in zip(outs, refs, reqs):
            # As the suites do (TestContext._reference_scorer): an engine token outside the reference's
            # top-k at the divergence is scored by the reference, teacher-forced, not failed unmeasured.
            def resolve(step, ids, r=r, q=q):
                return runner.step_logprobs(r, step, ids, paths[q.adapter] if q.adapter else None)

            try:
                ag = assert_logprobs_close(o, r, gross, label=str(q.adapter), check_prompt=False, resolve=resolve)
                stats["free_running"] = max(stats["free_running"], ag.max_decode_diff / gross.decode_atol)
                if ag.tie_at is None:
                    assert_rouge_l(o.text, r.text, gross.rouge_l_min, label=str(q.adapter))
            except ConformanceAssertionError as exc:
                failures["free_running"].append(f"free-running: {str(exc).splitlines()[0]}")
            try:
                ag = assert_logprobs_close(o, r, tol, label=str(q.adapter), check_prompt=False, resolve=resolve)
                stats["decode_default"] = max(stats.get("decode_default", 0.0), ag.max_decode_diff / tol.decode_atol)
                if ag.tie_at is None:
                    assert_rouge_l(o.text, r.text, tol.rouge_l_min, label=str(q.adapter))
            except ConformanceAssertionError as exc:
                failures["decode_default"].append(f"decode at default bounds: {str(exc).splitlines()[0]}")
        same = same_engine_tolerance_for(dtype, scale, ACTIVATION_SCHEME[0])
        for o, q in zip(outs[:4], reqs[:4]):
            try:
                ag = assert_logprobs_close(engine.generate([q])[0], o, same, label=f"{q.adapter} alone vs in the batch",
                                           check_prompt=False)
                stats["same_engine"] = max(stats.get("same_engine", 0.0), ag.max_decode_diff / same.decode_atol)
            except ConformanceAssertionError as exc:
                failures["same_engine"].append(f"same engine: {str(exc).splitlines()[0]}")
        if shape == "mixed":
            routing_check(rng, names, paths, prompts, engine, runner, failures, defects, new_tokens)
        return failures, stats, defects
    finally:
        for n in loaded:
            engine.unload_adapter(n)


def routing_check(rng, names, paths, prompts, engine, runner, failures, defects, new_tokens=16) -> None:
    """mixed_batch::nearest_reference_routing as the suite runs it: one prompt, each row one of the
    run's adapters or none (every label twice or more, in a random order), each output nearest its own
    label's isolated reference. Identical references are a suite defect (the test cannot check routing
    on that prompt), not an alarm."""
    labels = names * 3 + [None] * 2
    rng.shuffle(labels)
    prompt = rng.choice(prompts)
    outs = engine.generate([GenerationRequest(prompt, l, new_tokens, 5) for l in labels])
    iso = list(names) + [None]
    refs = dict(zip([n or "__base__" for n in iso], runner.generate([GenerationRequest(prompt, l, new_tokens, 5) for l in iso],
                                                                      paths)))
    try:
        assert_nearest_reference_routing(outs, labels, refs)
    except IndistinctReferencesError as exc:
        defects.append(f"routing: {exc}")
    except ConformanceAssertionError as exc:
        failures["routing"].append(f"routing: {str(exc).splitlines()[0]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--variations", default=",".join(VARIATIONS))
    ap.add_argument("--variant", action="append", default=[],
                    help="extra built-in engine arg set as a variation, e.g. variant=fp32_delta (repeatable)")
    ap.add_argument("--runs", type=int, default=200, help="null runs per dtype")
    ap.add_argument("--start", type=int, default=0,
                    help="index of the first null run in the family x variation cycle (split runs over processes)")
    ap.add_argument("--power-runs", type=int, default=10, help="runs per family, dtype and scale / drop / fault")
    ap.add_argument("--scales", default="0.9,0.95,1.03,1.05,1.1")
    ap.add_argument("--drops", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="modules whose LoRA the engine drops in the alllinear family's power runs")
    ap.add_argument("--faults", default=",".join(MOE_FAULTS),
                    help="built-in engine faults for power runs (moe_*: on the moe family; others: accuracy)")
    ap.add_argument("--reference-device", default="cpu", help="where the float32 reference runs")
    ap.add_argument("--profile", default="fast", help="certification profile whose bases and ranks the runs use")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each free-running decode generates")
    ap.add_argument("--base-quant", default="none",
                    help="quantise the bases (models/quant.py scheme); the reference runs on the snapped weights")
    ap.add_argument("--activations", default="float", choices=("float", "int8"),
                    help="int8: the built-in and PEFT engines read 8-bit activation blocks in front of a GGUF base's "
                         "quantised matmuls (engine arg activations=int8), judged by the rows for 8-bit activations")
    ap.add_argument("--one-engine", action="store_true",
                    help="hold one engine at a time at every scale (the real scale always does): a family that "
                         "alternates engines then rebuilds one every run, as at real shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=None, help="model, adapter and reference cache (default: the user's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", help="print the combined tables of earlier --json outputs")
    a = ap.parse_args()
    if a.merge:
        return merge(a)
    a.cache = a.cache or default_cache_dir()
    rng = random.Random(a.seed)
    models, runners = {}, {}
    from lora_conformance.models import profiles

    profile = profiles.get(a.profile)
    PROFILE_RANKS[0] = tuple(profile.ranks)
    specs = {"llama": profile.models.get("decoder", "synthetic:llama"), "moe": profile.models.get("moe", "synthetic:moe")}
    a.scale = "small"

    if a.activations == "int8":
        from lora_conformance.models.quant import GGUF_ACTIVATIONS

        if a.base_quant not in GGUF_ACTIVATIONS:
            ap.error(f"--activations int8 needs a GGUF base: --base-quant {' or '.join(GGUF_ACTIVATIONS)}")
        ACTIVATION_SCHEME[0] = GGUF_ACTIVATIONS[a.base_quant]
    engine_extra = {"activations": "int8"} if a.activations == "int8" else {}

    def model(kind):
        if kind not in models:
            models[kind] = resolve_base_model(specs[kind], a.cache / "models")
            if a.base_quant != "none":
                from lora_conformance.models.quant import snapped_checkpoint

                models[kind] = snapped_checkpoint(models[kind], a.base_quant, a.cache / "models" / "quantized")
            a.scale = max(a.scale, scale_of_model(models[kind]), key=("small", "real").index)
            runners[kind] = ReferenceRunner(models[kind], a.reference_device, "float32", ReferenceCache(a.cache / "references"))
        return models[kind], runners[kind]

    tmp = Path(tempfile.mkdtemp(prefix="lc-power-"))
    families = a.families.split(",")
    variations = a.variations.split(",") + [f"builtin:{v}" for v in a.variant]
    results = {}
    engines = {}

    def engine_for(var, dtype, kind, max_rank=None):
        model_dir, _ = model(kind)
        name = "peft" if var == "peft" else "builtin"
        args = dict(x.split("=", 1) for x in var.split(":", 1)[1].split(",")) if var.startswith("builtin:") else {}
        args = {**engine_extra, **args, **({"max_rank": str(max_rank)} if max_rank and name == "builtin" else {})}
        key = (name, dtype, kind, tuple(sorted(args.items())))
        if key not in engines:
            # at real shapes one engine at a time (a 24 GiB host holds one beside the reference's base and copy)
            for k in [k for k in engines if k[1] != dtype or a.scale != "small" or a.one_engine]:
                engines.pop(k).close()
            engines[key] = create_engine(name, model_dir, a.device, dtype, args)
        e = engines[key]
        if var == "merged":
            return Merged(e, lambda n, p: create_engine("builtin", merged_model(model_dir, p, tmp), a.device, dtype, {}))
        return Reversed(e) if var == "reverse" else OneAtATime(e) if var == "one_at_a_time" else e

    errors = []
    a.resident = []

    def run(fam, var, dtype, how):
        """One run; an exception (a harness problem, not a verdict) is recorded and the run not counted."""
        kind = FAMILIES[fam](random.Random(0))[2]
        model_dir, runner = model(kind)
        engine = engine_for(var, dtype, kind)
        try:
            return one_run(rng, fam, engine, runner, model_dir, a.cache, dtype, tmp, how, a.new_tokens,
                           lambda rank: engine_for(var, dtype, kind, max(rank, TestContext.HIGH_RANK)))
        except Exception as exc:  # noqa: BLE001 - counted apart, printed with the results
            import traceback

            errors.append({"family": fam, "variation": var, "dtype": dtype, "how": how,
                           "error": f"{type(exc).__name__}: {exc}"[:300],
                           "where": traceback.format_exc().splitlines()[-3:]})
            return None
        finally:
            if isinstance(engine, Merged):
                engine.close()
            # resident memory after each run: a process that grows run by run is seen before the OOM killer ends it
            a.resident.append([fam, var, how, *resident_gb()])
            print(f"run {len(a.resident)}: {fam} {var} {how or ''} resident {a.resident[-1][3]:.2f} GB "
                  f"(anonymous {a.resident[-1][4]:.2f} GB)", flush=True)

    try:
        for dtype in a.dtypes.split(","):
            t0 = time.time()
            null = {f: _null_row(f) for f in families}
            alarms = []
            power = {}
            for i in range(a.start, a.start + a.runs):
                fam, var = families[i % len(families)], variations[(i // len(families)) % len(variations)]
                how = var if var.split(":")[0] in {w.split(":")[0] for w in REWRITES} else None
                got = run(fam, var, dtype, how)
                if got is None:
                    _save_partial(a, results, dtype, null, alarms, power, t0, errors)
                    continue
                failures, stats, defects = got
                row = null[fam]
                row["runs"] += 1
                bad, informational = judged(fam, failures)
                row["false_alarms"] += bool(bad)
                for c in bad:
                    row["by_check"][c] += 1
                for c in informational:
                    row["not_applied"][c] = row["not_applied"].get(c, 0) + 1
                row["defects"] += bool(defects)
                row["variations"][var] = row["variations"].get(var, 0) + 1
                for k, v in stats.items():
                    row["worst"][k] = (min if k == "separation" else max)(row["worst"].get(k, v), v)
                if bad or informational or defects:
                    alarms.append({"family": fam, "variation": var, "failures": failures, "defects": defects,
                                   "applied": bad, "not_applied": informational})
                _save_partial(a, results, dtype, null, alarms, power, t0, errors)
            def power_cell(kind, key, fam, var, how):
                """``a.power_runs`` runs of one cell: [detected, runs, {check: runs it failed}] (every check,
                applied or not: the printed table tells them apart), saved after every run."""
                if a.power_runs < 1:
                    return  # no power runs asked for: no cell (a 0/0 row would read as measured)
                cell = [0, 0, {c: 0 for c in CHECKS}]
                for _ in range(a.power_runs):
                    got = run(fam, var, dtype, how)
                    if got is None:
                        continue
                    cell[0] += bool(judged(fam, got[0])[0])
                    cell[1] += 1
                    for c in CHECKS:
                        cell[2][c] += bool(got[0][c])
                    power.setdefault(kind, {})[key] = cell
                    _save_partial(a, results, dtype, null, alarms, power, t0, errors)
                power.setdefault(kind, {})[key] = cell

            for m in [x for x in a.drops.split(",") if x]:
                power_cell("drop", m, "alllinear", "default", f"drop:{m}")
            for fault in [x for x in a.faults.split(",") if x]:
                power_cell("fault", fault, fault_family(fault), f"builtin:fault={fault}", None)
            for fam in [f for f in families if f not in ("mixed", "alllinear", "moe")]:
                for s in [float(x) for x in a.scales.split(",") if x]:
                    power_cell(fam, s, fam, "default", f"scale:{s}")
            _save_partial(a, results, dtype, null, alarms, power, t0, errors)
            _print(dtype, null, power, alarms, a, [e for e in errors if e["dtype"] == dtype])
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)


def resident_gb() -> tuple[float, float]:
    """This process's resident memory now, in GB: all of it (VmRSS) and its anonymous part (RssAnon: what
    the OOM killer weighs; the rest is mostly the bases' safetensors, mapped from disk). Where /proc is
    absent, the peak so far, twice."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return tuple(round(int(fields[k].split()[0]) * 1024 / 1e9, 3) for k in ("VmRSS", "RssAnon"))
    except (OSError, KeyError):
        import resource

        peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)
        return peak, peak


def _null_row(family: str) -> dict:
    """One family's null runs: false alarms by applied check, and failures of the checks not applied."""
    return {"runs": 0, "false_alarms": 0, "by_check": {c: 0 for c in APPLIED[family]}, "not_applied": {},
            "defects": 0, "worst": {}, "variations": {}}


def _save_partial(a, results, dtype, null, alarms, power, t0, errors) -> None:
    """After every run: partial results survive a time limit."""
    if a.json:
        results[dtype] = {"null": null, "alarms": alarms[:200], "power": power, "seconds": time.time() - t0,
                          "scale": getattr(a, "scale", "small"), "new_tokens": a.new_tokens, "profile": a.profile,
                          "base_quant": a.base_quant, "activations": a.activations,
                          "errors": [e for e in errors if e["dtype"] == dtype][:20],
                          "resident_gb": [r for r in getattr(a, "resident", [])]}
        a.json.write_text(json.dumps(results, indent=1, default=str))


def merge(a) -> None:
    """Sum null runs and false alarms over several --json files (runs split over processes)."""
    combined: dict = {}
    for path in a.merge:
        for dtype, r in json.loads(path.read_text()).items():
            c = combined.setdefault(dtype, {"null": {}, "alarms": [], "power": {}, "errors": []})
            a.scale = r.get("scale", "small")
            c["errors"] += r.get("errors", [])
            for fam, row in r["null"].items():
                row = _judged_row(fam, row, r["alarms"])
                cr = c["null"].setdefault(fam, _null_row(fam))
                for k in ("runs", "false_alarms", "defects"):
                    cr[k] += row[k]
                for part in ("by_check", "not_applied"):
                    for k, v in row[part].items():
                        cr[part][k] = cr[part].get(k, 0) + v
                for k, v in row.get("variations", {}).items():
                    cr["variations"][k] = cr["variations"].get(k, 0) + v
                for k, v in row["worst"].items():
                    cr["worst"][k] = (min if k == "separation" else max)(cr["worst"].get(k, v), v)
            c["alarms"] += r["alarms"]
            for fam, by in r["power"].items():  # runs of one cell split over processes add up
                cell = c["power"].setdefault(fam, {})
                for k, v in by.items():
                    k = float(k) if fam not in ("drop", "fault") else k
                    old = cell.get(k, [0, 0, {}])
                    h, n = _counts(old)
                    h2, n2 = _counts(v)
                    checks = dict(old[2]) if isinstance(old, list) and len(old) > 2 else {}
                    for ck, cv in (v[2] if isinstance(v, list) and len(v) > 2 else {}).items():
                        checks[ck] = checks.get(ck, 0) + cv
                    cell[k] = [h + h2, n + n2, checks]
    for dtype, c in combined.items():
        _print(dtype, c["null"], c["power"], c["alarms"], a, c["errors"])


def _judged_row(family: str, row: dict, alarms: list) -> dict:
    """A null row of an older file (judged by every check, its free_running including the pooled prompt
    check) judged as now: the failures of checks not applied to the family moved apart, and its false
    alarms counted again from the file's alarms where it kept them all (200 at most)."""
    if "not_applied" in row:
        return row
    old = row.get("by_check", {})
    row = dict(row, by_check={}, not_applied={})
    for c, n in old.items():
        if n:
            row["by_check" if c in APPLIED[family] else "not_applied"][c] = n
    if len(alarms) < 200:
        row["false_alarms"] = sum(bool(judged(family, al["failures"])[0]) for al in alarms
                                  if al["family"] == family and isinstance(al["failures"], dict))
    return row


def _counts(v) -> tuple[int, int]:
    """[hits, runs] of a power cell (older files hold a rate: counted as one run)."""
    if isinstance(v, (list, tuple)):
        return int(v[0]), int(v[1])
    return (1 if v >= 1.0 else 0), 1


def _lower_bound(hits: int, runs: int) -> float:
    """One-sided 95% lower confidence bound on the detection rate when every run detected
    (Clopper-Pearson: 0.05 ** (1 / runs)); 0 otherwise (not claimed)."""
    return 0.05 ** (1 / runs) if runs and hits == runs else 0.0


def _print(dtype, null, power, alarms, a, errors=()):
    power = dict(power)
    tol = tolerance_for(dtype, getattr(a, "scale", "small"), ACTIVATION_SCHEME[0])
    acts = f", {tol.activations} activations" if tol.activations else ""
    print(f"\n== {dtype} on {a.device} ({tol.scale} scale rows{acts}): effect_noise {tol.effect_noise:g}, "
          f"noise_max {tol.effect_noise_max:g}, slope_margin {tol.effect_slope_margin:g}, prompt_rms_max "
          f"{tol.prompt_rms_max:g}, decode_atol {tol.decode_atol:g}, free_running_atol {tol.free_running_atol:g}, "
          f"gross {tol.effect_gross_atol:g}")
    print("worst statistic / its bound (resid, slope: teacher-forced contexts; p-resid, p-slope, p-max: the paired "
          "prompt check; free-run: the decode at the gross bounds; p-rms, p-gross: the pooled prompt logprobs; "
          "decode_d: the decode at the default per-step bounds)")
    print("alarms by check; (n): n runs failed a check the suites do not apply to the family (APPLIED): measured, "
          "never counted")
    keys = ("residual", "slope", "prompt_residual", "prompt_slope", "prompt_max", "free_running", "prompt_rms",
            "prompt_gross", "decode_default", "same_engine")
    print(f"{'family':10} {'runs':>5} {'alarms':>6} " + " ".join(f"{c[:8]:>8}" for c in CHECKS) +
          f" {'defects':>7} " + " ".join(f"{k.replace('prompt_', 'p-')[:8]:>8}" for k in keys) + f" {'gamma':>6}")
    for fam, r in null.items():
        w = r["worst"]
        cells = [str(r["by_check"].get(c, 0)) if c in APPLIED[fam] else f"({r['not_applied'].get(c, 0)})"
                 for c in CHECKS]
        print(f"{fam:10} {r['runs']:>5} {r['false_alarms']:>6} " + " ".join(f"{x:>8}" for x in cells) +
              f" {r['defects']:>7} " +
              " ".join(f"{w.get(k, 0):>8.3f}" for k in keys) +
              f" {max(w.get('gamma', 0), w.get('prompt_gamma', 0)):>6.2f}")
    total = sum(r["runs"] for r in null.values())
    fa = sum(r["false_alarms"] for r in null.values())
    applied_runs = {c: sum(r["runs"] for f, r in null.items() if c in APPLIED[f]) for c in CHECKS}
    per_check = {c: sum(r["by_check"].get(c, 0) for r in null.values()) for c in CHECKS}
    print(f"false alarms: {fa}/{total} runs (" + ", ".join(f"{c} {per_check[c]}/{n}" for c, n in applied_runs.items()
                                                            if n) +
          f"; 95% upper bound on the per-run rate: {min(1.0, 3 / max(total, 1)):.3g} when 0)")
    other = [f"{c} {r['not_applied'][c]}/{r['runs']} ({f})" for f, r in null.items() for c in CHECKS
             if r["not_applied"].get(c)]
    if other:
        print("not applied, not counted: " + ", ".join(other))
    variations: dict = {}
    for r in null.values():
        for v, n in r.get("variations", {}).items():
            variations[v] = variations.get(v, 0) + n
    if variations:
        print("runs per variation: " + ", ".join(f"{v} {n}" for v, n in sorted(variations.items())))
    def counted(al) -> list:
        return judged(al["family"], al["failures"])[0] if isinstance(al["failures"], dict) else [True]

    for al in sorted(alarms, key=lambda al: not (counted(al) or al["defects"]))[:8]:
        fails = al["failures"]
        flat = [x for c in CHECKS for x in fails.get(c, [])] if isinstance(fails, dict) else fails
        what = "alarm:" if counted(al) else "defect:" if al["defects"] else "not applied:"
        print(f"  {what}", al["family"], al["variation"], (flat + al["defects"])[:2])
    if errors:
        print(f"errors (runs not counted): {len(errors)}")
        for e in list(errors)[:5]:
            print("  error:", e["family"], e["variation"], e["error"], e.get("where", [])[-1:])
    cells = [("drop", m, "alllinear", v) for m, v in power.pop("drop", {}).items()]
    cells += [("fault", f, fault_family(f), v) for f, v in power.pop("fault", {}).items()]
    for kind, what, fam, v in cells:
        h, n = _counts(v)
        print(f"{kind} {what:32} detected {h}/{n}" + (f" (power >= {_lower_bound(h, n):.1%} at 95% confidence)"
                                                      if n and h == n else "") + "; " + _caught_by(fam, v))
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
        for s, v in sorted(by_scale.items(), key=lambda sv: float(sv[0])):
            if isinstance(v, list) and len(v) > 2:
                print(f"      x{float(s):g}: {_caught_by(fam, v)}")


def _caught_by(family: str, cell) -> str:
    """Which checks failed in a power cell's runs: those applied to ``family`` (detections), then the others."""
    checks = cell[2] if isinstance(cell, list) and len(cell) > 2 else None
    if not checks:
        return "by check: not recorded (an older file: detected by any check)"
    applied = ", ".join(f"{c} {k}" for c, k in checks.items() if c in APPLIED[family]) or "none"
    other = ", ".join(f"{c} {k}" for c, k in checks.items() if c not in APPLIED[family] and k)
    return f"caught by: {applied}" + (f"; not applied: {other}" if other else "")


if __name__ == "__main__":
    main()
