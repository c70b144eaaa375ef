"""Many reports -> one engine x device matrix (rows: features; columns: ``engine@device/dtype``).

Reports with the same column key (the shards of one CI run) are combined into one column by
concatenating their records and uniting their selections (a case one shard deselected and
another ran counts as run). A case one run left unfinished (stopped before its call ended: no
result) is replaced by the same case finished in another run of the column, so a certification
stopped by a time limit and resumed where it stopped makes one column, which names those cases;
a case with the same status in two runs keeps the first run's record; two results of different
statuses are refused. Every column is re-verified from its records and selection, so a
stored verdict is never trusted, and a column that did not run every feature is partial.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from html import escape
from pathlib import Path
from typing import Any, Iterable, Mapping

from lora_conformance.report.environment import column_key
from lora_conformance.report.markdown import ICON
from lora_conformance.judge.root_causes import describe, from_dicts, headline
from lora_conformance.report.selection import merge_selections
from lora_conformance.judge.verdict import classify, verify

MATRIX_SCHEMA = "lora-conformance/matrix/1"


class MergeConflict(ValueError):
    pass


def unfinished(record: Mapping[str, Any]) -> bool:
    """A case its run stopped before it finished (an interrupt, a time limit): no call phase, no
    failed or skipped phase. No result, so a finished run of the same case replaces it. A case
    whose worker crashed is a result (pytest-xdist reports its call failed), and so is an error in
    setup."""
    phases = record.get("phases") or {}
    return "call" not in phases and not {"failed", "skipped"} & set(phases.values())


def merge(reports: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    columns: dict[str, dict[str, Any]] = {}
    for report in reports:
        key = column_key(report.get("environment") or {})
        col = columns.setdefault(key, {"environment": report.get("environment") or {}, "records": {}, "runs": 0,
                                       "selections": [], "resumed": set()})
        col["runs"] += 1
        col["selections"].append(report.get("selection"))
        for rec in report["records"]:
            old = col["records"].get(rec["nodeid"])
            if old is None:
                col["records"][rec["nodeid"]] = rec
            elif classify(old)[0] == classify(rec)[0]:
                pass  # the same result twice (a resumed run that ran a finished case again): the first stands
            elif unfinished(rec):
                if not unfinished(old):
                    col["resumed"].add(rec["nodeid"])
            elif unfinished(old):
                col["records"][rec["nodeid"]] = rec
                col["resumed"].add(rec["nodeid"])
            else:
                # Two shards ran the same test with different results: refuse to pick one.
                raise MergeConflict(f"{key}: {rec['nodeid']} appears in two reports with different outcomes")
    out_cols, cells, features = [], {}, set()
    for key in sorted(columns):
        col = columns[key]
        try:
            selection = merge_selections(col["selections"], f"{key}: ")
        except ValueError as exc:
            raise MergeConflict(str(exc)) from None
        verdict = verify(col["records"].values(), selection)
        passed, counted = verdict.score()
        out_cols.append({
            "key": key,
            "runs": col["runs"],
            "environment": col["environment"],
            "summary": verdict.summary,
            "score": f"{passed}/{counted}",
            "status": verdict.status_text(),
            "resumed": sorted(col["resumed"]),
            "root_causes": [asdict(c) for c in verdict.root_causes],
        })
        for fid, feat in verdict.features.items():
            features.add(fid)
            cells.setdefault(fid, {})[key] = {"status": feat.status, "reason": feat.reason}
    return {
        "schema": MATRIX_SCHEMA,
        "columns": out_cols,
        "features": sorted(features),
        "cells": {fid: cells[fid] for fid in sorted(cells)},
    }


def render_matrix_markdown(matrix: Mapping[str, Any]) -> str:
    keys = [c["key"] for c in matrix["columns"]]
    lines = ["# LoRA conformance matrix", "", "## Root causes per column", ""]
    for c in matrix["columns"]:
        causes = from_dicts(c.get("root_causes") or [])
        lines.append(f"### `{c['key']}` ({c.get('status', '')}): {headline(causes)}")
        lines.append("")
        lines += [f"{i}. {describe(cause)}" for i, cause in enumerate(causes, start=1)]
        lines.append("")
    lines += ["## Features", "",
             "| Feature | " + " | ".join(f"`{k}`" for k in keys) + " |",
             "| --- |" + " --- |" * len(keys)]
    for fid in matrix["features"]:
        row = []
        for k in keys:
            cell = matrix["cells"][fid].get(k)
            row.append(f"{ICON[cell['status']]} {cell['status']}" if cell else "—")
        lines.append(f"| `{fid}` | " + " | ".join(row) + " |")
    lines.append("| **passed / counted** | " + " | ".join(f"**{c['score']}**" for c in matrix["columns"]) + " |")
    lines.append("| **status** | " + " | ".join(f"**{c.get('status', '')}**" for c in matrix["columns"]) + " |")
    lines.append("| **root causes** | " + " | ".join(f"**{len(c.get('root_causes') or [])}**"
                                                   for c in matrix["columns"]) + " |")
    lines += ["", "## Columns", ""]
    for c in matrix["columns"]:
        env = c["environment"]
        pk = env.get("packages") or {}
        dev = env.get("device") or {}
        lines.append(f"- `{c['key']}`: {c['runs']} run(s); engine {(env.get('engine') or {}).get('version') or '?'}; "
                     f"device {dev.get('device_name') or dev.get('name')}; torch {pk.get('torch')}; "
                     f"{env.get('date')}")
        resumed = c.get("resumed") or []
        if resumed:
            lines.append(f"  - {len(resumed)} case(s) one run left unfinished, finished by another: "
                         + ", ".join(f"`{n}`" for n in resumed))
    return "\n".join(lines) + "\n"


def render_matrix_html(matrix: Mapping[str, Any]) -> str:
    from lora_conformance.report.html import page, root_causes_html, status_badge

    keys = [c["key"] for c in matrix["columns"]]
    head = "<tr><th>feature</th>" + "".join(f"<th><code>{escape(k)}</code></th>" for k in keys) + "</tr>"
    rows = []
    for fid in matrix["features"]:
        tds = []
        for k in keys:
            cell = matrix["cells"][fid].get(k)
            tds.append(f"<td>{status_badge(cell['status'], cell['reason']) if cell else status_badge(None)}</td>")
        rows.append(f"<tr><td><code>{escape(fid)}</code></td>{''.join(tds)}</tr>")
    rows.append("<tr><th>passed / counted</th>" + "".join(f"<th>{escape(c['score'])}</th>"
                                                         for c in matrix["columns"]) + "</tr>")
    rows.append("<tr><th>status</th>" + "".join(f"<th>{escape(c.get('status', ''))}</th>"
                                               for c in matrix["columns"]) + "</tr>")
    rows.append("<tr><th>root causes</th>" + "".join(f"<th>{len(c.get('root_causes') or [])}</th>"
                                                      for c in matrix["columns"]) + "</tr>")
    causes_html = "".join(
        f"<h3><code>{escape(c['key'])}</code></h3>"
        + root_causes_html(from_dicts(c.get("root_causes") or []), heading="p")
        for c in matrix["columns"])
    body = ("<h1>LoRA conformance matrix</h1>"
            f'<p class="muted">{len(matrix["features"])} features, {len(keys)} engine/device columns; '
            "hover a status for its reason.</p>"
            f'<h2 id="root-causes">Root causes per column</h2>{causes_html}'
            f"<h2>Features</h2><table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>")
    return page("LoRA conformance matrix", body)


def write_matrix(matrix: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {n: out_dir / n for n in ("report.json", "report.md", "report.html")}
    paths["report.json"].write_text(json.dumps(matrix, indent=1, default=str) + "\n", encoding="utf-8")
    paths["report.md"].write_text(render_matrix_markdown(matrix), encoding="utf-8")
    paths["report.html"].write_text(render_matrix_html(matrix), encoding="utf-8")
    return paths
