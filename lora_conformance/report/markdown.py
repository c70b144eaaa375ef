"""report.md: verdict, root causes (each failure under its cause), feature table, selection, environment.

Everything that comes from a run (test ids, messages, evidence, environment) is text, never
markup: ``text`` escapes HTML and table pipes, ``code`` makes a code span that no backtick in
the value can close.
"""

from __future__ import annotations

import html
import re
import shlex
from typing import Any, Mapping

from lora_conformance.report.badge import badge_text
from lora_conformance.judge.verdict import STATUSES, Verdict

ICON = {"passed": "✅", "failed": "❌", "error": "💥", "xfail": "⚠️", "not certified": "➖", "skipped": "⏭️"}
MAX_NOT_RUN = 12


def text(value: Any) -> str:
    """Run-supplied text for a Markdown line or table cell: HTML escaped, one line, pipes escaped."""
    return html.escape(" ".join(str(value if value is not None else "").split()), quote=False).replace("|", "\\|")


def code(value: Any) -> str:
    """A code span of ``value`` (one line) that backticks inside it cannot close."""
    body = " ".join(str(value if value is not None else "").split()).replace("|", "\\|")
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if body.startswith("`") or body.endswith("`") or longest else ""
    return f"{fence}{pad}{body}{pad}{fence}"


_cell = text  # table cells


def _short(value: str, limit: int = 160) -> str:
    value = " ".join(str(value).split())
    return value if len(value) <= limit else value[: limit - 1] + "…"


def _plugins_cell(plugins: Any) -> str:
    if not isinstance(plugins, Mapping):
        return "-"  # a report from before plugins were recorded
    loaded = ", ".join(str(p) for p in plugins.get("loaded") or ()) or "none besides pytest's and lora_conformance's"
    return loaded + ("" if plugins.get("autoload") else " (auto-loading off)")


def environment_rows(env: Mapping[str, Any]) -> list[tuple[str, str]]:
    engine = env.get("engine") or {}
    device = env.get("device") or {}
    ref = env.get("reference") or {}
    pk = env.get("packages") or {}
    args = ", ".join(f"{k}={v}" for k, v in sorted((engine.get("args") or {}).items())) or "-"
    settings = engine.get("settings") or {}
    effective = ", ".join(f"{k}={v}" for k, v in (settings.get("effective") or {}).items()) or "-"
    differs = "; ".join(f"{k}={d.get('ours')} (engine default {d.get('engine_default')}: "
                        f"{d.get('why') or 'no reason given'})"
                        for k, d in (settings.get("differs_from_engine_default") or {}).items()) or "-"
    rows = [
        ("engine", f"{engine.get('name')} {engine.get('version') or ''}".strip()),
        ("engine args", args),
    ]
    if settings:  # the engine reports its effective settings (Engine.settings)
        rows += [("engine settings (effective)", effective), ("ours, not the engine's default", differs)]
    return rows + [
        ("device", " ".join(str(x) for x in (device.get("name"), device.get("device_name"),
                                             device.get("runtime") or device.get("driver")) if x)),
        ("dtype", str(env.get("dtype"))),
        ("reference", f"{ref.get('device')} / {ref.get('dtype')}"),
        *([("reference work", reference_work_summary(ref["work"]))] if isinstance(ref.get("work"), Mapping) else []),
        *([("device memory", device_memory_text(env["device_memory"]))]
          if isinstance(env.get("device_memory"), Mapping) else []),
        ("base model", str(env.get("base_model"))),
        *_profile_rows(env.get("profile"), env.get("base_model")),
        *_base_quant_rows(env.get("base_quant")),
        *_activation_rows(env.get("activations")),
        ("torch / transformers / peft", " / ".join(str(pk.get(n)) for n in ("torch", "transformers", "peft"))),
        ("pytest plugins", _plugins_cell(env.get("pytest_plugins"))),
        ("suite version", str(env.get("suite_version"))),
        ("python", f"{env.get('python')} on {env.get('platform')}"),
        ("git commit", str(env.get("git_commit") or "-")),
        ("date", str(env.get("date"))),
    ]


def reference_work_summary(work: Mapping[str, Any]) -> str:
    """What the run's references computed and what it took (environment ``reference.work``)."""
    def n(key: str) -> float:
        value = work.get(key)
        return value if isinstance(value, (int, float)) else 0

    return (f"{n('cache_hits'):.0f} cached, {n('computed'):.0f} computed in {n('compute_s'):.0f} s "
            f"({n('forward_passes'):.0f} forward passes); {n('copies'):.0f} adapted model copies in "
            f"{n('copy_s'):.0f} s; base loaded {n('base_loads'):.0f} times in {n('base_load_s'):.0f} s; "
            f"summed over {n('processes'):.0f} processes"
            + (f"; {n('rotary_recomputed'):.0f} rotary tables computed again (a platform fault: "
               f"reference/rotary_guard.py)" if n('rotary_recomputed') else ""))


def device_memory_text(memory: Mapping[str, Any]) -> str:
    """The run's device memory peaks (environment ``device_memory``, ``recorder.device_memory_summary``)."""
    def gib(key: str) -> str:
        value = memory.get(key)
        return f"{(value if isinstance(value, (int, float)) else 0) / 2**30:.1f} GiB"

    n = memory.get("processes")
    return (f"{gib('largest_peak_reserved')} reserved ({gib('largest_peak_allocated')} in tensors) by the "
            f"largest of {n} process{'es' if n != 1 else ''}; {gib('summed_peak_reserved')} reserved summed over "
            "them (an upper bound: the peaks need not coincide); torch's allocator, the runtime's own memory aside"
            + (f"; the most one case held: {gib('largest_case_peak_allocated')} in tensors "
               f"({memory['largest_case']})" if memory.get("largest_case") else ""))


def _profile_rows(profile: Any, base_model: Any = None) -> list[tuple[str, str]]:
    """The certification profile (environment ``profile``, models/profiles.py ``describe``): its ranks,
    adapter counts and prompt lengths, then the shape of each of its bases the run used (not the
    decoder's where ``--base-model`` named another); none for a report without a profile."""
    if not isinstance(profile, Mapping):
        return []
    ranks = ", ".join(str(r) for r in profile.get("ranks") or ()) or "-"
    loaded, batch = profile.get("loaded_adapters"), profile.get("batch_adapters")
    adapters = (f"{loaded} adapters loaded, {batch} in one batch" if loaded and batch
                else "adapters loaded and batched to the engine's own limits")
    prompts = "; ".join(f"{tokens} tokens in chunks of {chunk}" if tokens
                        else f"the default prompts in chunks of {chunk}"
                        for tokens, chunk in (p for p in profile.get("long_prompts") or () if len(p) == 2)) or "-"
    reference = ("the reference on the device under test (float32)" if profile.get("reference_on_device")
                 else "the reference where its row says")
    rows = [("profile", f"{profile.get('name')}: ranks {ranks} (and the engine's max_rank); {adapters}; "
                        f"long prompts {prompts}; {reference}")]
    for kind, shape in sorted((profile.get("model_shapes") or {}).items()):
        if isinstance(shape, Mapping) and not (kind == "decoder" and base_model and shape.get("model") != base_model):
            rows.append((f"{kind} base shape", _shape_text(shape)))
    return rows


def _shape_text(shape: Mapping[str, Any]) -> str:
    """``synthetic:qwen2.5-1.5b: hidden 1536, 28 layers, 12 heads (2 kv, head_dim 128), ...``."""
    def n(key: str) -> str:
        value = shape.get(key)
        return f"{value:,}" if isinstance(value, int) else str(value)

    if "hidden" not in shape:
        return str(shape.get("model"))
    parts = [f"hidden {n('hidden')}", f"{n('layers')} layers",
             f"{n('heads')} heads ({n('kv_heads')} kv, head_dim {n('head_dim')})",
             f"intermediate {n('intermediate')}", f"vocab {n('vocab')}"]
    if shape.get("experts"):
        parts.append(f"{n('experts')} experts (intermediate {n('expert_intermediate')}, top {n('top_k_experts')})")
    parts.append(f"{n('max_positions')} positions")
    return f"{shape.get('model')}: " + ", ".join(parts)


def _base_quant_rows(quant: Any) -> list[tuple[str, str]]:
    """A quantised base: its scheme, and how the reference was made."""
    if not isinstance(quant, Mapping):
        return []
    return [("base quantisation", f"{quant.get('scheme')}: {quant.get('description')}"),
            ("reference made by", str(quant.get("reference")))]


def _activation_rows(acts: Any) -> list[tuple[str, str]]:
    """An engine whose quantised-base matmuls read quantised activations: which, and the widened rows."""
    if not isinstance(acts, Mapping):
        return []
    row = acts.get("rows") if isinstance(acts.get("rows"), Mapping) else {}
    return [("activations", f"{acts.get('scheme')}: {acts.get('description')} ({acts.get('declared_by')}); judged "
                            f"with the tolerance rows for {acts.get('tolerance_class')} activations "
                            f"(judge/tolerances.py ACTIVATIONS, {', '.join(sorted(row)) or 'no dtype'} widened; "
                            "an engine compared with itself: SAME_ENGINE, its per-step decode only)")]


def selection_rows(report: Mapping[str, Any], verdict: Verdict) -> list[tuple[str, str]]:
    """What the run selected (schema 2), for the report's "Run" table."""
    from lora_conformance.report.selection import narrowing

    selection = report.get("selection")
    if not isinstance(selection, Mapping):
        return [("selection", "not recorded (a report written before runs recorded their selection)")]
    cov = verdict.summary.get("coverage") or {}
    suite = selection.get("suite") or {}
    rows = [
        ("coverage", f"{cov.get('features_run')} of {cov.get('features_declared')} features ran"
                     + ("" if cov.get("complete") else " (partial)")),
        ("selected by", ", ".join(narrowing(selection)) or "nothing: the whole suite"),
        ("pytest arguments", " ".join(shlex.quote(str(a)) for a in selection.get("args") or ()) or "-"),
        ("suite files", f"{len(suite.get('files') or {})} files, sha256 {str(suite.get('sha256') or '-')[:16]}…, "
                        f"lora-conformance {suite.get('version')}"),
    ]
    if selection.get("shards"):
        rows.append(("shards", str(selection["shards"])))
    starts = engine_starts_summary(report)
    if starts:
        rows.append(("engine starts", starts))
    workers = workers_summary(report)
    if workers:
        rows.append(("workers", workers))
    return rows


def workers_summary(report: Mapping[str, Any]) -> str:
    """Each worker's tests, busy seconds and when its last test ended (records' ``worker``,
    ``started`` and ``duration``), and how long the workers that ended first then idled: an
    unbalanced run shows here. Empty for a run of one process or records without them."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in report.get("records") or ():
        if isinstance(r, Mapping) and isinstance(r.get("worker"), str) and isinstance(r.get("started"), (int, float)):
            spans.setdefault(r["worker"], []).append((float(r["started"]), float(r.get("duration") or 0.0)))
    if len(spans) < 2:
        return ""
    ends = {w: max(s + d for s, d in v) for w, v in spans.items()}
    last = max(ends.values())
    parts = [f"{w}: {len(v)} tests, busy {sum(d for _, d in v):.0f} s, done at {ends[w]:.0f} s"
             for w, v in sorted(spans.items())]
    idle = sum(last - e for e in ends.values())
    return "; ".join(parts) + f" (idle at the end: {idle:.0f} s summed over workers)"


def engine_starts_summary(report: Mapping[str, Any]) -> str:
    """How many engines the run started, their seconds, and why (records' ``engine_starts``)."""
    starts = [s for r in report.get("records") or [] if isinstance(r, Mapping)
              for s in r.get("engine_starts") or () if isinstance(s, Mapping)]
    if not starts:
        return ""
    seconds = [float(s.get("seconds") or 0) for s in starts]
    whys: dict[str, list[float]] = {}
    for s, t in zip(starts, seconds):
        whys.setdefault(str(s.get("why") or "-"), []).append(t)
    parts = [f"{len(ts)} {why} ({sum(ts):.0f} s)" for why, ts in sorted(whys.items(), key=lambda kv: -sum(kv[1]))]
    return f"{len(starts)} in {sum(seconds):.0f} s, summed over workers: " + "; ".join(parts)


def rerun_command(env: Mapping[str, Any], nodeid: str) -> str:
    """The command that runs one case again on the engine and device of the report."""
    engine = env.get("engine") or {}
    device = env.get("device") or {}
    parts = ["python", "-m", "pytest", nodeid, f"--device={device.get('type') or 'cpu'}",
             f"--engine={engine.get('name') or 'builtin'}"]
    parts += [f"--engine-arg={k}={v}" for k, v in sorted((engine.get("args") or {}).items())]
    if env.get("dtype"):
        parts.append(f"--dtype={env['dtype']}")
    if env.get("base_model") and env.get("base_model") != "synthetic:llama":
        parts.append(f"--base-model={env['base_model']}")
    if isinstance(env.get("base_quant"), Mapping):
        parts.append(f"--base-quant={env['base_quant'].get('scheme')}")
    return " ".join(shlex.quote(str(p)) for p in parts)


def partial_lines(report: Mapping[str, Any], verdict: Verdict) -> list[str]:
    from lora_conformance.report.selection import narrowing

    if not verdict.partial:
        return []
    cov = verdict.summary["coverage"]
    narrowed = narrowing(report.get("selection"))
    not_run = cov.get("not_run") or []
    shown = ", ".join(code(f) for f in not_run[:MAX_NOT_RUN]) + (
        f" and {len(not_run) - MAX_NOT_RUN} more" if len(not_run) > MAX_NOT_RUN else "")
    return [f"> **Partial run: {cov['features_run']} of {cov['features_declared']} features ran**"
            + (f", selected by {text(', '.join(narrowed))}" if narrowed else "")
            + ". A partial run certifies nothing: run the whole suite to certify.",
            f"> Not run: {shown}.", ""]


def _counts(cause: Any) -> str:
    return ", ".join(f"{n} {st}" for st, n in cause.statuses.items())


def root_causes_markdown(causes: list, report: Mapping[str, Any] | None = None,
                         cases: Mapping[str, Any] | None = None) -> list[str]:
    """The report's first section: ``N root causes``, each headed by its diagnosis, with each
    failure under it (its message as it was, and the command that reruns it)."""
    from lora_conformance.judge.root_causes import headline

    env = (report or {}).get("environment") or {}
    lines = [f"## Root causes: {headline(causes)}", ""]
    for i, cause in enumerate(causes, start=1):
        nfeat = len(cause.features)
        lines += [f"### {i}. {text(cause.title)}", "",
                  f"{_counts(cause)}; {nfeat} feature{'s' if nfeat != 1 else ''}: "
                  + ", ".join(code(f) for f in cause.features), ""]
        by_place = set(cause.by_place)
        for nodeid in cause.cases:
            case = (cases or {}).get(nodeid)
            status = f" ({case.status})" if case is not None else ""
            message = cause.messages.get(nodeid) or ""
            mark = " — no diagnosis of its own (same suite)" if nodeid in by_place else ""
            lines.append(f"- {code(nodeid)}{status}{mark}: {text(_short(message, 300))}")
            if report is not None:
                lines.append(f"  - rerun: {code(rerun_command(env, nodeid))}")
        lines.append("")
    return lines


def certification_markdown(report: Mapping[str, Any], verdict: Verdict) -> list[str]:
    """The run's mode, its waivers apart from what passed (issue, suite version, re-confirmed) and its audit."""
    cert = report.get("certification")
    summary = verdict.summary.get("certification")
    if not isinstance(cert, Mapping) or not isinstance(summary, Mapping):
        return []
    audit = cert.get("audit") or {}
    lines = ["", f"## Certification: {text(summary['mode'])} run of suite {text(summary.get('suite_version'))}", "",
             f"Waived: {summary['waived_features']} features ({summary['waived_cases']} cases), counted apart from "
             f"the passed ones. Audit: {summary['audit_sampled']} passed cases asked again of a fresh engine in "
             f"reversed batch order, {summary['audit_mismatches']} different.", ""]
    if cert.get("waived"):
        lines += ["| Case | Waiver | Issue | Recorded against | Re-confirmed |", "| --- | --- | --- | --- | --- |"]
        for w in cert["waived"]:
            again = {True: "yes", False: "**no: it no longer fails**", None: "not needed"}[w.get("reconfirmed")]
            lines.append(f"| {code(w['nodeid'])} | {text(w['status'])} | {text(w.get('issue') or '-')} | "
                         f"{text(w.get('recorded_against') or '-')} | {again} |")
    for m in audit.get("mismatches") or ():
        lines.append(f"- audit: {code(m.get('nodeid'))}: {text(_short(str(m.get('difference')), 300))}")
    return lines


def render_markdown(report: Mapping[str, Any], verdict: Verdict) -> str:
    env = report.get("environment") or {}
    device = (env.get("device") or {}).get("type") or "unknown"
    label, value = badge_text(verdict, device)
    s = verdict.summary
    by = s["features_by_status"]
    cases = {c.nodeid: c for c in verdict.cases}
    lines = [
        f"# LoRA conformance report: {text((env.get('engine') or {}).get('name'))} on {text(device)}",
        "",
        f"**{text(label)} · {text(value)}**: {text(verdict.status_text())}. "
        f"{s['features']} features: " + ", ".join(f"{by[k]} {k}" for k in STATUSES if by[k]) + ". "
        f"{s['cases']} cases.",
        "",
        *partial_lines(report, verdict),
        *root_causes_markdown(verdict.root_causes, report, cases),
        "## Features",
        "",
        "| Feature | Description | Status | passed | failed | error | xfail | not certified | skipped | Reason |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for fid, feat in verdict.features.items():
        c = feat.counts
        lines.append(
            f"| {code(fid)} | {text(feat.description)} | {ICON[feat.status]} {feat.status} | {c['passed']} | "
            f"{c['failed']} | {c['error']} | {c['xfail']} | {c['not certified']} | {c['skipped']} | "
            f"{text(_short(feat.reason))} |")
    notes = [(r.get("nodeid"), n) for r in report.get("records") or [] if isinstance(r, Mapping)
             for n in r.get("notes") or ()]
    if notes:
        lines += ["", "## What the passing tests could not establish", ""]
        lines += [f"- {code(nodeid)}: {text(_short(str(n), 300))}" for nodeid, n in notes]
    lines += certification_markdown(report, verdict)
    lines += ["", "## Run", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {text(v)} |" for k, v in selection_rows(report, verdict)]
    if report.get("legacy"):
        lines.append("| report | schema 1: its checksum covered the records only (not the environment) |")
    if report.get("unverified"):
        lines.append(f"| report | {text(report['unverified'])} |")
    lines += ["", "## Environment", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {text(v)} |" for k, v in environment_rows(env)]
    lines += ["", "The HTML report beside this file shows each failure's evidence (token tables, margins, "
                  "effect plots) inside its root cause.", ""]
    return "\n".join(lines)
