"""report.html: one self-contained page (inline CSS, no script, nothing fetched).

Sections: verdict and summary (a partial run says so first), the root causes, each headed by
its diagnosis with its failures inside (message, evidence: token diff, per-step table with
margins, effect plots, the raw evidence; the command that reruns it), the feature matrix, the
run's selection, the environment. Every value from a run is escaped.
"""

from __future__ import annotations

import hashlib
import json
import re
from html import escape
from pathlib import Path
from string import Template
from typing import Any, Iterable, Mapping, Optional

from lora_conformance.report.badge import badge_color, badge_text, render_badge
from lora_conformance.report.markdown import environment_rows, rerun_command, selection_rows
from lora_conformance.judge.verdict import STATUSES, Verdict

_TEMPLATE = Template((Path(__file__).with_name("template.html")).read_text(encoding="utf-8"))
MAX_ROWS = 64


def page(title: str, body: str) -> str:
    return _TEMPLATE.substitute(title=escape(title), body=body)


def case_anchor(nodeid: str) -> str:
    """The id of a failing case's block in report.html (the scoreboard links to it)."""
    return "case-" + hashlib.sha256(nodeid.encode("utf-8")).hexdigest()[:12]


def feature_anchor(feature_id: str) -> str:
    """The id of a feature's row in report.html's feature matrix."""
    return "feature-" + re.sub(r"[^A-Za-z0-9_-]", "-", feature_id)


def status_badge(status: Optional[str], title: str = "") -> str:
    if not status:
        return '<span class="status st-none">—</span>'
    t = f' title="{escape(title)}"' if title else ""
    return f'<span class="status st-{status.replace(" ", "-")}"{t}>{escape(status)}</span>'


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    return str(value)


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], cls: Iterable[str] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    head = f"<thead><tr>{head}</tr></thead>" if head.replace("<th></th>", "") else ""
    body = []
    classes = list(cls)
    for i, row in enumerate(rows):
        c = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        body.append(f"<tr{c}>" + "".join(row) + "</tr>")
    return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"


def _token_diff(rows: list[dict]) -> str:
    """Reference and engine tokens side by side, differing steps highlighted."""
    if not rows or not all(isinstance(r, dict) for r in rows):
        return ""
    if not any("reference_text" in r or "reference_token" in r for r in rows):
        return ""

    def strip(side: str) -> str:
        spans = []
        for r in rows:
            tok = r.get(f"{side}_text", r.get(f"{side}_token"))
            cls = ' class="diff"' if r.get("same") is False else ""
            spans.append(f"<span{cls}>{escape(_fmt(tok))}</span>")
        return f'<div class="tokens"><b>{side}</b>{"".join(spans)}</div>'

    return strip("reference") + strip("engine")


def evidence_html(evidence: Any) -> str:
    if not isinstance(evidence, dict):
        return ""
    parts = []
    scalars = [(k, v) for k, v in evidence.items() if k != "rows" and not isinstance(v, (dict, list))]
    if scalars:
        parts.append("<p>" + " · ".join(f"<b>{escape(str(k))}</b>: {escape(_fmt(v))}" for k, v in scalars) + "</p>")
    rows = evidence.get("rows")
    if isinstance(rows, list) and rows:
        parts.append(_token_diff(rows))
        dict_rows = [r for r in rows[:MAX_ROWS] if isinstance(r, dict)]
        keys: list[str] = []
        for r in dict_rows:
            keys += [k for k in r if k not in keys]
        cells = [[f'<td class="{"margin" if "margin" in k else ""}">{escape(_fmt(r.get(k)))}</td>' for k in keys]
                 for r in dict_rows]
        bad = ["bad" if (r.get("same") is False or r.get("ok") is False) else "" for r in dict_rows]
        parts.append(_table(keys, cells, bad))
        if len(rows) > MAX_ROWS:
            parts.append(f'<p class="muted">{len(rows) - MAX_ROWS} more rows in report.json</p>')
    parts.append("<details><summary>raw evidence</summary><pre>"
                 + escape(json.dumps(evidence, indent=1, default=str)) + "</pre></details>")
    return "".join(parts)


def _summary_html(verdict: Verdict) -> str:
    by = verdict.summary["features_by_status"]
    return '<p class="counts">' + "".join(
        f"<span>{status_badge(s)} {by[s]}</span>" for s in STATUSES if by[s]) + (
        f'<span class="muted">{verdict.summary["features"]} features, {verdict.summary["cases"]} cases</span></p>')


def _failure_html(case: Any, record: Any, env: Mapping[str, Any], by_place: bool) -> str:
    from lora_conformance.report.effects_svg import figures

    failed = case.status in ("failed", "error", "xfail")
    note = ('<p class="muted">no diagnosis of its own: a comparison failure in the suite of this cause</p>'
            if by_place else "")
    return (f'<div class="failure" id="{case_anchor(case.nodeid)}">'
            f"<h4>{status_badge(case.status)} <code>{escape(case.nodeid)}</code></h4>{note}"
            f"<pre>{escape(case.reason[:4000])}</pre>"
            + evidence_html(case.evidence)
            + figures(getattr(record, "effects", None) or [], with_distances=failed)
            + f'<p class="muted">rerun: <code>{escape(rerun_command(env, case.nodeid))}</code></p>'
            + (f"<details><summary>traceback</summary><pre>{escape(case.longrepr)}</pre></details>"
               if case.longrepr else "")
            + "</div>")


def root_causes_html(causes: list, heading: str = "h2", cases: Optional[Mapping[str, Any]] = None,
                     records: Optional[Mapping[str, Any]] = None, env: Optional[Mapping[str, Any]] = None) -> str:
    """``N root causes``, each headed by its diagnosis, with its features and (given ``cases``)
    each of its failures inside it."""
    from lora_conformance.report.effects_svg import EXPLANATION
    from lora_conformance.judge.root_causes import headline

    parts = [f'<{heading} class="root-causes" id="root-causes">Root causes: {escape(headline(causes))}</{heading}>']
    if cases is not None and any(getattr((records or {}).get(n), "effects", None) for c in causes for n in c.cases):
        parts.append(EXPLANATION)
    sub = "h3" if heading == "h2" else "h4"
    for i, cause in enumerate(causes, start=1):
        counts = ", ".join(f"{n} {s}" for s, n in cause.statuses.items())
        block = [f'<section class="cause"><{sub}>{i}. {escape(cause.title)}</{sub}>',
                 f'<p class="muted">{escape(counts)}; features: '
                 + ", ".join(f"<code>{escape(f)}</code>" for f in cause.features) + "</p>"]
        if cases is not None:
            by_place = set(cause.by_place)
            block += [_failure_html(cases[n], (records or {}).get(n), env or {}, n in by_place)
                      for n in cause.cases if n in cases]
        elif cause.example:
            block.append(f'<p class="muted">e.g. {escape(cause.example[:300])}</p>')
        parts.append("".join(block) + "</section>")
    return "".join(parts)


def environment_html(env: Mapping[str, Any]) -> str:
    return _table(("", ""), [[f"<th>{escape(k)}</th>", f"<td>{escape(v)}</td>"] for k, v in environment_rows(env)])


def _verdict_status(verdict: Verdict) -> str:
    by = verdict.summary["features_by_status"]
    if verdict.certified:
        return "passed"
    return "failed" if by["failed"] or by["error"] else "not certified"  # a partial run included


def certification_html(report: Mapping[str, Any], verdict: Verdict) -> str:
    """The run's mode, its waivers apart from what passed, and its audit ('' for a report without them)."""
    cert, summary = report.get("certification"), verdict.summary.get("certification")
    if not isinstance(cert, Mapping) or not isinstance(summary, Mapping):
        return ""
    out = [f'<h2 id="certification">Certification: {escape(str(summary["mode"]))} run of suite '
           f'{escape(str(summary.get("suite_version")))}</h2>',
           f'<p>Waived: {summary["waived_features"]} features ({summary["waived_cases"]} cases), counted apart from '
           f'the passed ones. Audit: {summary["audit_sampled"]} passed cases asked again of a fresh engine in '
           f'reversed batch order, {summary["audit_mismatches"]} different.</p>']
    again = {True: "yes", False: "no: it no longer fails", None: "not needed"}
    rows = [[f"<td><code>{escape(w['nodeid'])}</code></td>", f"<td>{escape(str(w['status']))}</td>",
             f"<td>{_link(w.get('issue'))}</td>", f"<td>{escape(str(w.get('recorded_against') or '-'))}</td>",
             f"<td>{again[w.get('reconfirmed')]}</td>"] for w in cert.get("waived") or ()]
    if rows:
        out.append(_table(("case", "waiver", "issue", "recorded against", "re-confirmed"), rows))
    mismatches = (cert.get("audit") or {}).get("mismatches") or ()
    if mismatches:
        out.append("<ul>" + "".join(f"<li>audit: <code>{escape(str(m.get('nodeid')))}</code>: "
                                    f"{escape(str(m.get('difference')))}</li>" for m in mismatches) + "</ul>")
    return "\n".join(out)


def _link(url: Optional[str]) -> str:
    if not url:
        return "-"
    safe = escape(str(url))
    return f'<a href="{safe}">{safe}</a>' if str(url).startswith(("https://", "http://")) else safe


def render_html(report: Mapping[str, Any], verdict: Verdict) -> str:
    from lora_conformance.evidence import as_records
    from lora_conformance.report.effects_svg import effects_html

    env = report.get("environment") or {}
    device = (env.get("device") or {}).get("type") or "unknown"
    engine = (env.get("engine") or {}).get("name")
    label, value = badge_text(verdict, device)
    records = {r.nodeid: r for r in as_records(report.get("records") or [])}
    cases = {c.nodeid: c for c in verdict.cases}
    body = [
        f"<h1>LoRA conformance: {escape(str(engine))} on {escape(device)}</h1>",
        render_badge(label, value, badge_color(verdict)),
        f'<p class="verdict">{status_badge(_verdict_status(verdict))} {escape(verdict.status_text())}: '
        f"{escape(value)} features pass</p>",
    ]
    if verdict.partial:
        cov = verdict.summary["coverage"]
        from lora_conformance.report.selection import narrowing

        narrowed = narrowing(report.get("selection"))
        body.append('<p class="partial"><b>Partial run: '
                    f"{cov['features_run']} of {cov['features_declared']} features ran</b>"
                    + (f", selected by {escape(', '.join(narrowed))}" if narrowed else "")
                    + ". A partial run certifies nothing: run the whole suite to certify.</p>"
                    + (f'<p class="muted">Not run: {escape(", ".join(cov.get("not_run") or []))}</p>'))
    body += [
        _summary_html(verdict),
        root_causes_html(verdict.root_causes, cases=cases, records=records, env=env),
        '<h2 id="matrix">Feature matrix</h2>',
    ]
    rows = []
    for fid, feat in verdict.features.items():
        c = feat.counts
        rows.append([f'<td id="{feature_anchor(fid)}">'
                     f'<code title="{escape(feat.description)}">{escape(fid)}</code></td>',
                     f"<td>{status_badge(feat.status)}</td>"]
                    + [f'<td class="num">{c[s]}</td>' for s in STATUSES]
                    + [f"<td>{escape(feat.reason[:300])}</td>"])
    body.append(_table(("feature", "status") + STATUSES + ("reason",), rows))
    notes = [(nodeid, n) for nodeid, r in records.items() for n in r.notes or ()]
    if notes:
        body.append('<h2 id="notes">What the passing tests could not establish</h2><ul>'
                    + "".join(f"<li><code>{escape(str(k))}</code>: {escape(str(n))}</li>" for k, n in notes)
                    + "</ul>")
    body.append(effects_html(verdict.cases, records))
    body.append(certification_html(report, verdict))
    body.append('<h2 id="run">Run</h2>')
    run_rows = selection_rows(report, verdict)
    if report.get("legacy"):
        run_rows.append(("report", "schema 1: its checksum covered the records only (not the environment)"))
    if report.get("unverified"):
        run_rows.append(("report", str(report["unverified"])))
    body.append(_table(("", ""), [[f"<th>{escape(k)}</th>", f"<td>{escape(v)}</td>"] for k, v in run_rows]))
    body.append('<h2 id="environment">Environment</h2>')
    body.append(environment_html(env))
    return page(f"LoRA conformance: {engine} on {device} ({value})", "\n".join(body))
