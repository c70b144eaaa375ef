"""report.md: summary, feature x status table, failures in one line each, environment."""

from __future__ import annotations

from typing import Any, Mapping

from lora_conformance.report.badge import badge_text
from lora_conformance.report.verify import STATUSES, Verdict

ICON = {"passed": "✅", "failed": "❌", "error": "💥", "xfail": "⚠️", "not certified": "➖", "skipped": "⏭️"}


def _cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ").strip()


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plugins_cell(plugins: Any) -> str:
    if not isinstance(plugins, Mapping):
        return "-"  # a report from before plugins were recorded
    loaded = ", ".join(plugins.get("loaded") or ()) or "none besides pytest's and lora_conformance's"
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
        ("device", " ".join(str(x) for x in (device.get("name"), device.get("device_name"), device.get("runtime") or device.get("driver")) if x)),
        ("dtype", str(env.get("dtype"))),
        ("reference", f"{ref.get('device')} / {ref.get('dtype')}"),
        ("base model", str(env.get("base_model"))),
        ("torch / transformers / peft", " / ".join(str(pk.get(n)) for n in ("torch", "transformers", "peft"))),
        ("pytest plugins", _plugins_cell(env.get("pytest_plugins"))),
        ("suite version", str(env.get("suite_version"))),
        ("python", f"{env.get('python')} on {env.get('platform')}"),
        ("git commit", str(env.get("git_commit") or "-")),
        ("date", str(env.get("date"))),
    ]


def root_causes_markdown(causes: list) -> list[str]:
    """The report's first section: ``N root causes`` and the features under each."""
    from lora_conformance.report.root_causes import headline

    lines = [f"## Root causes: {headline(causes)}", ""]
    for i, cause in enumerate(causes, start=1):
        counts = ", ".join(f"{n} {st}" for st, n in cause.statuses.items())
        lines.append(f"{i}. `{_cell(cause.signature)}` ({counts}; {len(cause.features)} "
                     f"feature{'s' if len(cause.features) != 1 else ''})")
        lines += [f"   - `{fid}`" for fid in cause.features]
        if cause.example:
            lines.append(f"   - e.g. {_cell(_short(cause.example, 200))}")
    return lines + [""]


def render_markdown(report: Mapping[str, Any], verdict: Verdict) -> str:
    env = report.get("environment") or {}
    device = (env.get("device") or {}).get("type") or "unknown"
    label, value = badge_text(verdict, device)
    s = verdict.summary
    by = s["features_by_status"]
    lines = [
        f"# LoRA conformance report: {(env.get('engine') or {}).get('name')} on {device}",
        "",
        f"**{label} · {value}**: {'certified' if s['certified'] else 'not certified'}. "
        f"{s['features']} features: " + ", ".join(f"{by[k]} {k}" for k in STATUSES if by[k]) + ". "
        f"{s['cases']} cases.",
        "",
        *root_causes_markdown(verdict.root_causes),
        "## Features",
        "",
        "| Feature | Description | Status | passed | failed | error | xfail | not certified | skipped | Reason |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for fid, feat in verdict.features.items():
        c = feat.counts
        lines.append(
            f"| `{fid}` | {_cell(feat.description)} | {ICON[feat.status]} {feat.status} | {c['passed']} | {c['failed']} | {c['error']} | "
            f"{c['xfail']} | {c['not certified']} | {c['skipped']} | {_cell(_short(feat.reason))} |"
        )
    failures = [c for c in verdict.cases if c.status in ("failed", "error")]
    if failures:
        lines += ["", "## Failures", ""]
        for case in failures:
            summary = (case.evidence or {}).get("summary") if isinstance(case.evidence, dict) else None
            lines.append(f"- `{case.nodeid}` ({case.status}): {_short(summary or case.reason, 300)}")
    notes = [(r.get("nodeid"), n) for r in report.get("records") or [] if isinstance(r, Mapping)
             for n in r.get("notes") or ()]
    if notes:
        lines += ["", "## What the passing tests could not establish", ""]
        lines += [f"- `{nodeid}`: {_short(str(n), 300)}" for nodeid, n in notes]
    lines += ["", "## Environment", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in environment_rows(env)]
    lines += ["", "The HTML report beside this file shows each failure's evidence (token tables, margins).", ""]
    return "\n".join(lines)
