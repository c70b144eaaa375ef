"""Paired adapter effects at teacher-forced contexts: the engine's and the reference's, side by side.

For each request row of a test (an adapter label, or None for a base row, and a prompt) the
reference decodes greedily; every prefix of that continuation is a *context*. The engine is
asked for one token after each context (``generate(max_new_tokens=1, top_k=k)``: nothing
diverges and bfloat16 rounding does not compound), once with the row's adapter (all rows in
one call, so the test's batch composition is kept) and once without any. The reference
scores the same contexts in one forward pass per sequence, for the correct hypothesis and
for each alternative (``lora_conformance.judge.hypotheses``). ``compare.effects`` pools the points
per adapter and judges them.

Base rows of a mixed batch are judged the same way with a zero reference effect: their
alternatives are "served as X" for each adapter X of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance.judge import hypotheses as hyps
from lora_conformance.judge.effects import EffectAnalysis, EffectSample, analyse
from lora_conformance.types import GenerationRequest

CONTEXTS_PER_PROMPT = 8
ENGINE_TOP_K = 20  # vLLM's default max_logprobs
REFERENCE_TOP = 32
MIN_COMMON_IDS = 3
BASE_LABEL = "base"


@dataclass
class Row:
    label: Optional[str]
    prompt: str
    sequence: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    texts: list[Optional[str]] = field(default_factory=list)  # None: re-tokenisation differs, skipped


@dataclass
class Plan:
    """What one conformance check sends and compares."""

    labels: list[Optional[str]]
    prompts: list[str]
    adapters: dict[str, Path]
    alternatives: dict[str, list[hyps.Hypothesis]]
    required: Optional[dict[str, set]] = None  # per label: hypotheses the test certifies (None: all)
    contexts_per_prompt: int = CONTEXTS_PER_PROMPT
    top_k: int = ENGINE_TOP_K
    # (max_new_tokens, top_k) of the free-running decode the same check makes of each row (None: none):
    # the contexts are read from that very reference decode, so a row costs the reference one decode.
    decode: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class Alternatives:
    """What a paired check must tell from the correct serving beyond the standard alternatives
    (``hypotheses.standard`` per adapter, "served as" each other adapter of the batch)."""

    # Single modules dropped are certified, not only judged where separable (the target-set tests,
    # whose adapters make every module's effect visible).
    modules: bool = False
    # Adapters no request uses that a row might wrongly get (a reloaded name's old weights), by the
    # name their "served as" alternative carries: name -> an adapter ref (path, spec or default name).
    old: Mapping[str, Any] = field(default_factory=dict)


def plan(labels: Sequence[Optional[str]], prompts: Sequence[str], adapters: Mapping[str, Path],
         old: Mapping[str, Path] = {}, modules: bool = False, decode: Optional[tuple[int, int]] = None) -> Plan:
    """One paired check: a row per label (None: a base row) in that order, prompts taken in turn,
    ``adapters`` the labels' directories, ``old`` those of ``Alternatives.old``, ``decode`` the
    (max_new_tokens, top_k) of the check's free-running decode (``Plan.decode``)."""
    paths = {**adapters, **old}
    alternatives = default_alternatives(labels, paths, extra=list(old))
    return Plan(list(labels), [prompts[i % len(prompts)] for i in range(len(labels))], paths, alternatives,
                required_hypotheses(alternatives, modules), decode=decode)


def contexts_of(runner, label: Optional[str], prompt: str, path: Optional[Path], n: int,
                decode: Optional[tuple[int, int]] = None) -> Row:
    """The row's contexts: the prompt plus each prefix (0 .. n-1 tokens) of the reference's greedy
    continuation, kept only where the text re-tokenises to exactly those ids. ``decode``: the
    (max_new_tokens, top_k) of a decode of the same row the caller also asks for; the prefixes are
    read from that one (a greedy decode's first n tokens do not depend on how many follow)."""
    tokens, top_k = decode or (n, 5)
    ref = runner.generate([GenerationRequest(prompt=prompt, adapter=label, max_new_tokens=max(n, tokens), top_k=top_k)],
                          {label: path} if label else {})[0]
    prompt_ids = list(ref.prompt_token_ids)
    seq = prompt_ids + list(ref.token_ids[: n - 1])
    row = Row(label, prompt, seq, [len(prompt_ids) - 1 + j for j in range(n)])
    tok = runner.tokenizer
    grown = prompt if tok(prompt).input_ids == prompt_ids else None
    for j in range(n):
        ids = seq[: len(prompt_ids) + j]
        text = tok.decode(ids, skip_special_tokens=True)
        if tok(text).input_ids != ids:
            # Tokenizers whose decode does not round-trip (words joined without spaces, say):
            # grow the prompt's own text one token at a time, with or without a separating space.
            text = grown if j == 0 else None
            if grown is not None and j > 0:
                piece = tok.decode([seq[len(prompt_ids) + j - 1]], skip_special_tokens=True)
                text = next((c for c in (grown + piece, grown + " " + piece) if tok(c).input_ids == ids), None)
        grown = text
        row.texts.append(text)
    return row


def _centred(values: dict[int, float], ids: Sequence[int]) -> list[float]:
    xs = [values[t] for t in ids]
    m = sum(xs) / len(xs)
    return [x - m for x in xs]


def run(plan: Plan, engine, runner, tol) -> list[EffectAnalysis]:
    """Engine calls, reference scoring and the statistics of ``plan``; one analysis per label.
    An engine that declares fewer logprobs per token (``Limits.max_top_k``) than the comparison
    needs in common with the reference is not certified (cause ``limit``), not judged."""
    limit = getattr(engine.limits, "max_top_k", None)
    if limit is not None and limit < MIN_COMMON_IDS:
        from lora_conformance.outcomes import limit_too_small

        limit_too_small("top-k logprobs per generated token (the paired check)", MIN_COMMON_IDS, limit)
    rows: list[Row] = [None] * len(plan.labels)  # type: ignore[list-item]
    own: dict[int, list] = {}  # each row scored under its own adapter, on the model its decode just used
    for i in runner.by_model(range(len(plan.labels)), lambda i: _path(plan, plan.labels[i])):
        label = plan.labels[i]
        rows[i] = contexts_of(runner, label, plan.prompts[i], _path(plan, label), plan.contexts_per_prompt, plan.decode)
        own[i] = _row_scorer(runner, rows[i])(_path(plan, label), None, None)
    slots = [(i, j) for j in range(plan.contexts_per_prompt) for i, r in enumerate(rows) if r.texts[j] is not None]
    with_adapter = engine.generate([GenerationRequest(rows[i].texts[j], rows[i].label, 1, plan.top_k)
                                    for i, j in slots])
    without = engine.generate([GenerationRequest(rows[i].texts[j], None, 1, plan.top_k) for i, j in slots])
    got_a = {s: (o.logprobs[0] if o.logprobs else {}) for s, o in zip(slots, with_adapter)}
    got_b = {s: (o.logprobs[0] if o.logprobs else {}) for s, o in zip(slots, without)}
    return _pooled(plan, runner, rows, got_a, got_b, tol, own)


def run_prompt_logprobs(plan: Plan, engine, runner, tol) -> list[EffectAnalysis]:
    """The same paired statistics over *prompt* logprobs: every prompt position is a teacher-forced
    context already (the prompt is the forced text). The engine is asked for its prompt logprobs
    (``prompt_logprobs=True``, ``plan.top_k`` per position) once with each row's adapter, all rows in
    one call, and once without any; the reference scores the same positions (``context_logprobs``)
    under the correct hypothesis and each alternative. A row whose prompt logprobs are missing or
    cover another number of positions than the reference's tokenisation fails the check."""
    from lora_conformance.judge.errors import ConformanceAssertionError

    rows = []
    for label, prompt in zip(plan.labels, plan.prompts):
        ids = list(runner.tokenizer(prompt).input_ids)
        rows.append(Row(label, prompt, ids, list(range(len(ids) - 1)), [prompt] * (len(ids) - 1)))
    with_adapter = engine.generate([GenerationRequest(r.prompt, r.label, 1, plan.top_k, prompt_logprobs=True)
                                    for r in rows])
    without = engine.generate([GenerationRequest(r.prompt, None, 1, plan.top_k, prompt_logprobs=True) for r in rows])
    got_a, got_b = {}, {}
    for i, (r, a, b) in enumerate(zip(rows, with_adapter, without)):
        for what, out, got in (("with its adapter", a, got_a), ("without adapter", b, got_b)):
            pl = out.prompt_logprobs
            if pl is None or len(pl) != len(r.positions):
                raise ConformanceAssertionError(
                    f"row {i} ({r.label or BASE_LABEL}) {what}: prompt logprobs cover "
                    f"{'no' if pl is None else len(pl)} positions, the reference's tokenisation "
                    f"{len(r.positions)} (prompt {r.prompt!r})",
                    {"check": "prompt_effects", "row": i, "summary": "prompt logprobs missing or misaligned"})
            got.update({(i, j): dict(pl[j] or {}) for j in range(len(pl))})
    return _pooled(plan, runner, rows, got_a, got_b, tol)


def _pooled(plan: Plan, runner, rows: list[Row], got_a: dict, got_b: dict, tol,
            own: Optional[dict[int, list]] = None) -> list[EffectAnalysis]:
    """Per label: the centred engine effect ``E`` and reference effects (correct ``R``, each
    alternative ``H``) at every context ``(row, position index)`` the engine answered. ``got_a``:
    the engine's logprobs with the row's adapter, ``got_b``: without it, keyed by (row, position).
    ``own``: the rows' scores under their own adapters where the caller has them already."""
    # Every reference score the verdict needs, computed model by model (the runner's by_model): a row
    # scored under its own adapter first (its top ids are what the other scores read), then under the
    # base and each alternative. Row by row, a batch of 32 adapters whose rows are each scored
    # "served as" the 31 others made an adapted model copy per score (about 1,000 copies of a
    # 7 GB base per batch at the full profile); adapter by adapter, one per adapter and pass.
    # Each score depends only on its model, row, hypothesis and ids: the order changes no value.
    if own is None:
        own = {i: _row_scorer(runner, rows[i])(_path(plan, rows[i].label), None, None)
               for i in runner.by_model(range(len(rows)), lambda i: _path(plan, rows[i].label))}
    ids_of = {i: [sorted(step) for step in adapted] for i, adapted in own.items()}
    # (row, what: None for the base, else the alternative's name; adapter path; hypothesis)
    jobs: list[tuple[int, Optional[str], Optional[Path], Optional[hyps.Hypothesis]]] = []
    for i, r in enumerate(rows):
        if _path(plan, r.label) is not None:
            jobs.append((i, None, None, hyps.base()))
    for label in dict.fromkeys(plan.labels):
        path = _path(plan, label)
        for h in plan.alternatives.get(label or BASE_LABEL, []):
            for i in (i for i, r in enumerate(rows) if r.label == label):
                if h.kind == "served_as":
                    jobs.append((i, h.name, plan.adapters[h.adapter], None))
                elif h.kind != hyps.BASE:
                    jobs.append((i, h.name, path, h))
    def model_of(j: int) -> Optional[Path]:  # the base hypothesis runs on the base model
        hyp = jobs[j][3]
        return None if hyp is not None and hyp.kind == hyps.BASE else jobs[j][2]

    scores: dict[tuple[int, Optional[str]], list] = {}
    for j in runner.by_model(range(len(jobs)), model_of):
        i, what, path, hyp = jobs[j]
        scores[(i, what)] = _row_scorer(runner, rows[i])(path, hyp, ids_of[i])

    samples: dict[str, EffectSample] = {}
    for label in dict.fromkeys(plan.labels):
        row_ids = [i for i, r in enumerate(rows) if r.label == label]
        name = label or BASE_LABEL
        path = _path(plan, label)
        alts = plan.alternatives.get(name, [])
        ref_adapted = [own[i] for i in row_ids]
        ref_base = [scores[(i, None)] if path else own[i] for i in row_ids]
        ref_alternative = {h.name: [ref_base[k] if h.kind == hyps.BASE else scores[(i, h.name)]
                                    for k, i in enumerate(row_ids)] for h in alts}
        sample = EffectSample(name, required=(plan.required or {}).get(name))
        for k, i in enumerate(row_ids):
            for j in range(len(rows[i].positions)):
                if (i, j) not in got_a:
                    sample.contexts_skipped += 1
                    continue
                engine_a, engine_b = got_a[(i, j)], got_b[(i, j)]
                reference_a, reference_b = ref_adapted[k][j], ref_base[k][j]
                # Paired (engine minus engine base) where the base run reports the ids; else the
                # engine's adapted logprobs against the reference base (a strong adapter moves the
                # top-k so far that the two runs share few ids).
                ids_a = sorted(engine_a.keys() & reference_a.keys())
                common = sorted(engine_a.keys() & engine_b.keys() & reference_a.keys())
                paired = len(common) >= MIN_COMMON_IDS and 2 * len(common) >= len(ids_a)
                if not paired:
                    common = ids_a
                if len(common) < MIN_COMMON_IDS:
                    sample.contexts_skipped += 1
                    continue
                context = sample.contexts
                sample.contexts += 1
                sample.contexts_unpaired += not paired
                engine_base = engine_b if paired else reference_b
                engine_effect = [x - y for x, y in zip(_centred(engine_a, common), _centred(engine_base, common))]
                reference_effect = ([x - y for x, y in zip(_centred(reference_a, common), _centred(reference_b, common))]
                                    if path else [0.0] * len(common))
                sample.E += engine_effect
                sample.R += reference_effect
                sample.cluster += [context] * len(common)
                for h in alts:
                    alternative = ref_alternative[h.name][k][j]
                    effect = [x - y for x, y in zip(_centred(alternative, common), _centred(reference_b, common))]
                    sample.H.setdefault(h.name, []).extend(effect)
        samples[name] = sample
    return [analyse(s, tol) for s in samples.values()]


def _path(plan: Plan, label: Optional[str]) -> Optional[Path]:
    """The adapter directory of a row's label (None: a base row)."""
    return plan.adapters.get(label) if label else None


def _row_scorer(runner, row: Row):
    def score(path, hyp, ids):
        return runner.context_logprobs([row.sequence], [row.positions], path, hyp,
                                       ids=None if ids is None else [ids], top=REFERENCE_TOP)[0]
    return score


def required_hypotheses(alternatives: Mapping[str, list[hyps.Hypothesis]],
                        modules: bool = False) -> dict[str, set]:
    """What a test certifies: every alternative except single modules dropped, unless ``modules``
    (the target-set tests, whose adapters make every module's effect visible)."""
    return {l: {h.name for h in alts if modules or h.kind != "drop"} for l, alts in alternatives.items()}


def default_alternatives(labels: Sequence[Optional[str]], adapters: Mapping[str, Path],
                         routing: bool = True, extra: Sequence[str] = ()) -> dict[str, list[hyps.Hypothesis]]:
    """Per label: ``hypotheses.standard`` (with "served as" each other adapter of the test when
    ``routing``); base rows: "served as" each adapter."""
    names = [l for l in dict.fromkeys(labels) if l]
    out = {}
    for l in names:
        others = ([o for o in names if o != l] if routing else []) + [e for e in extra if e != l]
        out[l] = hyps.standard(adapters[l], others)
    if None in labels and names:
        out[BASE_LABEL] = [hyps.served_as(o) for o in names]
    return out
