"""report.json: build, write (with report.md, report.html, badge.svg beside it), load.

report.json keeps the execution records *and* the verdict derived from them; readers that
re-verify (``report render``, ``report merge``) recompute the verdict from the records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from lora_conformance.report.verify import Verdict, verify

SCHEMA = "lora-conformance/report/1"


class ReportFormatError(ValueError):
    pass


def build_report(environment: Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    records = sorted((dict(r) for r in records), key=lambda r: r["nodeid"])
    verdict = verify(records)
    return {
        "schema": SCHEMA,
        "environment": dict(environment),
        "verdict": verdict.as_dict(),
        "records": records,
    }


def device_type(report: Mapping[str, Any]) -> str:
    return ((report.get("environment") or {}).get("device") or {}).get("type") or "unknown"


def write_report(report: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write report.json/md/html and badge.svg; the verdict is recomputed from the records."""
    from lora_conformance.report.badge import badge_svg
    from lora_conformance.report.html import render_html
    from lora_conformance.report.markdown import render_markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verdict = verify(report["records"])
    report = {**report, "verdict": verdict.as_dict()}
    paths = {name: out_dir / name for name in ("report.json", "report.md", "report.html", "badge.svg")}
    paths["report.json"].write_text(json.dumps(report, indent=1, sort_keys=False, default=str) + "\n",
                                    encoding="utf-8")
    paths["report.md"].write_text(render_markdown(report, verdict), encoding="utf-8")
    paths["report.html"].write_text(render_html(report, verdict), encoding="utf-8")
    paths["badge.svg"].write_text(badge_svg(verdict, device_type(report)), encoding="utf-8")
    return paths


def load_report(path: Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportFormatError(f"{path}: cannot read a report: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportFormatError(f"{path}: expected schema {SCHEMA!r}, got {got!r}")
    if not isinstance(data.get("records"), list):
        raise ReportFormatError(f"{path}: no 'records' list")
    return data


def reverify(report: Mapping[str, Any]) -> tuple[Verdict, bool]:
    """(verdict recomputed from the records, whether it equals the stored one)."""
    verdict = verify(report["records"])
    return verdict, verdict.as_dict() == report.get("verdict")
