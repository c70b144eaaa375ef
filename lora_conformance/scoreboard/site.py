"""The scoreboard's pages: the matrix (``index.html``, ``aligned.html``) and each report's page.

Pages use report.html's template and status colours (``report.html.page``, ``status_badge``); a
report's own page *is* its report.html rendering (``render_html``), under a banner that says what
the scoreboard found: integrity, revocation, certification (mode, waivers, audit), superseded.
``scoreboard.js`` only filters what is there (engine, device, dtype, status; the query string
keeps the choice); without it every column and row shows.
"""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Mapping
from urllib.parse import quote

from lora_conformance.report.html import page, status_badge
from lora_conformance.scoreboard import board

LEGEND = (
    ("passed", "the engine matched the reference"),
    ("waived", "fails as an upstream issue filed against this suite version says (certified run)"),
    ("xfail", "an expected failure of an open run (its expectations file)"),
    ("failed", "the engine differs from the reference"),
    ("error", "the test could not run to the end"),
    ("not certified", "the engine does not declare what the feature needs"),
    ("skipped", "not applicable here"),
)
INTEGRITY = (
    ("verified", "signed by a key the scoreboard holds, digest ok"),
    ("unverified", "unsigned, signed by an unknown key, or a digest that covers less (schema 1) or nothing"),
    ("tampered", "changed after the run or after signing: shown, never trusted"),
    ("revoked", "withdrawn (revoked.toml): struck through"),
)


def stored_suffix(entry: board.Entry) -> str:
    name = entry.path.name
    return next((s for s in (".json.xz", ".json.gz") if name.endswith(s)), ".json")


def _head(css: str = "scoreboard.css") -> str:
    return f'<link rel="stylesheet" href="{css}">'


def _column_classes(c: board.Entry) -> str:
    return " ".join(["col", f"integrity-{c.integrity.level}"] + (["revoked"] if c.revoked else []))


def _column_head(c: board.Entry) -> str:
    revoked = f'<span class="why">revoked: {escape(c.revoked)}</span>' if c.revoked else ""
    mode = "certified run" if c.mode == "certified" else "open run"
    return (f'<th class="{_column_classes(c)}" data-engine="{escape(c.engine)}" data-device="{escape(c.device)}" '
            f'data-dtype="{escape(c.dtype)}" data-suite="{escape(c.suite_version)}" '
            f'title="{escape(c.engine_version)} · {escape(c.date)} · {escape(c.rel)}">'
            f'<a href="r/{quote(c.slug)}.html">{escape(c.engine)}</a>'
            + (f'<span class="variant">{escape(c.variant)}</span>' if c.variant else "")
            + f"<span>{escape(c.device)} · {escape(c.dtype)}</span>"
            f'<span class="suite">suite {escape(c.suite_version)}</span>'
            f'<span class="mode mode-{c.mode}">{mode}</span>'
            f'<span class="verdict{" partial" if c.verdict.partial else ""}">{escape(c.verdict.status_text())}</span>'
            f'<span class="integrity">{escape(c.integrity.level)}</span>'
            f'<span class="counts">{escape(c.count_text())}</span>{revoked}</th>')


def _cell(c: board.Entry, fid: str) -> str:
    cell = c.cells.get(fid)
    if cell is None:
        return f'<td class="{_column_classes(c)}" data-status="">{status_badge(None, "not in this run")}</td>'
    words = [cell.status] + ([f"root cause: {cell.diagnosis}"] if cell.diagnosis else []) + (
        [cell.reason[:300]] if cell.reason else []) + [f"waived: {w.get('issue')}" for w in cell.waivers[:3]]
    label = status_badge(cell.status)
    return (f'<td class="{_column_classes(c)}" data-status="{escape(cell.status)}">'
            f'<a href="r/{quote(c.slug)}.html#{quote(cell.anchor)}" title="{escape(" — ".join(words))}">'
            f"{label}</a></td>")


def _select(name: str, values: Iterable[str], label: str) -> str:
    options = "".join(f'<option value="{escape(v)}">{escape(v)}</option>' for v in sorted(set(values)))
    return (f'<label>{escape(label)} <select name="{name}" id="filter-{name}"><option value="">all</option>'
            f"{options}</select></label>")


def matrix_html(columns: list, aligned: bool) -> str:
    shown = [c for c in columns if not aligned or c.suite_version in board.aligned_versions(columns)]
    if not shown:
        return '<p class="muted">No column to show: no suite version was run by every product.</p>'
    head = "<tr><th>feature</th>" + "".join(_column_head(c) for c in shown) + "</tr>"
    rows = "".join(f'<tr data-feature="{escape(fid)}"><th><code>{escape(fid)}</code></th>'
                   + "".join(_cell(c, fid) for c in shown) + "</tr>" for fid in board.feature_rows(shown))
    filters = ('<form id="filters" class="filters">'
               + _select("engine", (c.engine for c in shown), "engine")
               + _select("device", (c.device for c in shown), "device")
               + _select("dtype", (c.dtype for c in shown), "dtype")
               + _select("status", board.CELL_STATUSES, "status")
               + '<span id="shown" class="muted"></span></form>')
    return (filters + f'<div class="scroll"><table id="board" class="board"><thead>{head}</thead>'
            f"<tbody>{rows}</tbody></table></div>")


def legend_html() -> str:
    statuses = "".join(f"<li>{status_badge(s)} {escape(words)}</li>" for s, words in LEGEND)
    marks = "".join(f'<li><span class="mark integrity-{s}{" revoked" if s == "revoked" else ""}">{escape(s)}</span>'
                    f" {escape(words)}</li>" for s, words in INTEGRITY)
    return (f'<div class="legend"><ul>{statuses}</ul><ul>{marks}</ul>'
            '<p class="muted">Counts read <code>41 passed, 12 waived / 62</code>: passed and waived features '
            "apart, out of every feature that applies (an open run counts its expected failures as xfail). "
            "Each cell links to that feature in its report: a failure to its case, under its diagnosis.</p></div>")


def _role(e: board.Entry) -> str:
    if e.superseded_by:
        return f'superseded by <a href="r/{quote(e.superseded_by)}.html">{escape(e.superseded_by)}</a>'
    return "in the matrix"


def reports_html(b: Any) -> str:
    rows = []
    for e in b.entries:
        cls = f'integrity-{e.integrity.level}{" revoked" if e.revoked else ""}'
        rows.append(
            f'<tr class="{cls}"><td><a href="r/{quote(e.slug)}.html">{escape(e.rel)}</a></td>'
            f"<td>{escape(e.product_label)}</td><td>{escape(e.suite_version)}</td><td>{escape(e.mode)}</td>"
            f"<td>{escape(e.date)}</td><td>{escape(e.verdict.status_text())}</td><td>{escape(e.count_text())}</td>"
            f'<td><span class="mark integrity-{e.integrity.level}">{escape(e.integrity.level)}</span> '
            f"{escape(e.integrity.words())}"
            + (f'<br><span class="why">revoked: {escape(e.revoked)}</span>' if e.revoked else "")
            + ('<br><span class="why">stored verdict differs from its records</span>'
               if not e.stored_verdict_same else "") + f"</td><td>{_role(e)}</td></tr>")
    out = ('<h2 id="reports">Every report read</h2><table class="reports"><thead><tr><th>file</th><th>product</th>'
           "<th>suite</th><th>mode</th><th>date</th><th>verdict</th><th>features</th><th>integrity</th>"
           f"<th>shown</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")
    if b.unreadable:
        out += ('<h2 id="unreadable">Files that could not be read as reports</h2><ul>'
                + "".join(f"<li><code>{escape(rel)}</code>: {escape(err)}</li>" for rel, err in b.unreadable)
                + "</ul>")
    if b.unmatched_revocations:
        out += ('<h2 id="unmatched">Revocations that match no report here</h2><ul>'
                + "".join(f"<li><code>{escape(d)}</code>: {escape(r)}</li>" for d, r in b.unmatched_revocations.items())
                + "</ul>")
    return out


def index_page(b: Any, aligned: bool) -> str:
    versions = sorted({c.suite_version for c in b.columns})
    same = sorted(board.aligned_versions(b.columns))
    view = ('<nav class="views"><a href="index.html" id="view-all"' + ("" if aligned else ' class="on"')
            + '>all suite versions</a> <a href="aligned.html" id="view-aligned"' + (' class="on"' if aligned else "")
            + ">aligned: only suite versions every product ran</a></nav>")
    title = "LoRA conformance scoreboard" + (" (aligned)" if aligned else "")
    body = (f"{_head()}<h1>{escape(title)}</h1>"
            f'<p class="muted">{len(b.entries)} reports read from <code>{escape(b.reports_dir)}</code>, '
            f"{len({c.product for c in b.columns})} products, suite versions {escape(', '.join(versions) or '-')} "
            f"(aligned: {escape(', '.join(same) or 'none')}). Every report's digest and signature were checked "
            "when this page was built.</p>"
            + view + legend_html() + matrix_html(b.columns, aligned) + reports_html(b)
            + '<script src="scoreboard.js"></script>')
    return page(title, body)


def banner_html(e: board.Entry) -> str:
    cert = e.report.get("certification")
    parts = [_head("../scoreboard.css"), '<p><a href="../index.html">&larr; scoreboard</a> · '
             f'<a href="{quote(e.slug + stored_suffix(e))}">the stored report</a> '
             f"(digest <code>{escape(e.digest or 'none')}</code>)</p>",
             f'<p><span class="mark integrity-{e.integrity.level}">{escape(e.integrity.level)}</span> '
             f"{escape(e.integrity.words())}</p>"]
    if e.integrity.detail:
        parts.append(f'<p class="muted">{escape(e.integrity.detail)}</p>')
    if e.revoked:
        parts.append(f'<p class="why"><b>Revoked</b>: {escape(e.revoked)}</p>')
    if e.superseded_by:
        parts.append(f'<p>Superseded in the matrix by <a href="{quote(e.superseded_by)}.html">'
                     f"{escape(e.superseded_by)}</a>.</p>")
    if isinstance(cert, Mapping):  # report.html's own section lists the waivers and the audit
        parts.append(f"<p><b>{escape(e.mode)} run</b> of suite {escape(e.suite_version)}: {escape(e.count_text())}; "
                     '<a href="#certification">its waivers and audit</a>'
                     + (f"; waivers from <code>{escape(str(cert['expectations']))}</code>" if cert.get("expectations")
                        else "") + "</p>")
    else:
        parts.append(f"<p><b>open run</b> of suite {escape(e.suite_version)} (written before certified mode: no "
                     f"certification block): {escape(e.count_text())}</p>")
    return f'<div class="sb-banner integrity-{e.integrity.level}">{"".join(parts)}</div>'


def report_page(e: board.Entry) -> str:
    from lora_conformance.report.html import render_html

    html = render_html(e.report, e.verdict)
    return html.replace("<body>", "<body>\n" + banner_html(e), 1)
