"""report.json: build, write (with report.md, report.html, badge.svg beside it), load.

report.json (schema ``lora-conformance/report/2``) keeps what a reader trusts:

- ``environment``: what was certified (engine, device, dtype, versions; ``environment.fingerprint``),
- ``selection``: what the run selected and the suite files it ran (``selection.describe``),
- ``records``: one ``evidence.Record`` per test,
- ``verdict``: derived from the records and the selection (readers recompute it),
- ``digest``: sha256 over all of the above (``canonical_bytes``): an edit of any of it, the
  environment included, is evident. A digest is a checksum written by the run, not a
  signature: it catches an edited or damaged file, not someone who recomputes it; a signature
  over ``canonical_bytes`` (``report/signing``) does that.

Reports of schema 1 are read by ``legacy.upgrade`` and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from lora_conformance.evidence import Record, RecordFormatError, as_records
from lora_conformance.errors import ReportDigestError, ReportFormatError  # noqa: F401 (readers catch them from here)
from lora_conformance.judge.verdict import Verdict, verify

SCHEMA = "lora-conformance/report/2"
# Top-level keys no digest or signature can cover (they are computed over the rest).
UNCOVERED_KEYS = ("digest", "signature")


def canonical_bytes(report: Mapping[str, Any]) -> bytes:
    """The bytes a digest or a signature of ``report`` covers: every top-level key but ``digest``
    and ``signature``, as JSON with sorted keys, no whitespace, UTF-8 (as the file holds it)."""
    covered = {k: v for k, v in report.items() if k not in UNCOVERED_KEYS}
    plain = json.loads(json.dumps(covered, default=str))
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def report_digest(report: Mapping[str, Any]) -> dict[str, str]:
    return {"sha256": hashlib.sha256(canonical_bytes(report)).hexdigest()}


def _finish(report: Mapping[str, Any]) -> tuple[dict[str, Any], Verdict]:
    """``report`` with its verdict recomputed from records and selection, and its digest."""
    records = sorted((r.as_dict() for r in as_records(report["records"])), key=lambda r: r["nodeid"])
    verdict = verify(records, report.get("selection"), report.get("certification"))
    out = {"schema": SCHEMA, "environment": dict(report.get("environment") or {}),
           "selection": report.get("selection"), "records": records, "verdict": verdict.as_dict()}
    if report.get("certification") is not None:  # its mode, waivers and audit (reports from before have none)
        out["certification"] = report["certification"]
    for mark in ("legacy", "unverified"):  # rendered from a schema-1 or an unchecked report: stays marked
        if report.get(mark):
            out[mark] = report[mark]
    out["digest"] = report_digest(out)
    return out, verdict


def build_report(environment: Mapping[str, Any], records: Iterable["Record | Mapping[str, Any]"],
                 selection: Optional[Mapping[str, Any]] = None,
                 certification: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    report = {"environment": environment, "selection": selection, "records": list(records)}
    if certification is not None:
        report["certification"] = certification
    return _finish(report)[0]


def device_type(report: Mapping[str, Any]) -> str:
    return ((report.get("environment") or {}).get("device") or {}).get("type") or "unknown"


def write_report(report: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write report.json/md/html and badge.svg; the verdict and digest are recomputed."""
    from lora_conformance.report.badge import badge_svg
    from lora_conformance.report.html import render_html
    from lora_conformance.report.markdown import render_markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report, verdict = _finish(report)
    paths = {name: out_dir / name for name in ("report.json", "report.md", "report.html", "badge.svg")}
    paths["report.json"].write_text(json.dumps(report, indent=1, sort_keys=False, default=str) + "\n",
                                    encoding="utf-8")
    paths["report.md"].write_text(render_markdown(report, verdict), encoding="utf-8")
    paths["report.html"].write_text(render_html(report, verdict), encoding="utf-8")
    paths["badge.svg"].write_text(badge_svg(verdict, device_type(report)), encoding="utf-8")
    return paths


# ---- reading ------------------------------------------------------------------------------------

_ENV_TEXT = ("dtype", "base_model", "suite_version", "python", "platform", "git_commit", "date")
_ENV_OBJECTS = {"engine": ("name", "version"), "device": ("name", "type", "device_name", "runtime", "driver"),
                "reference": ("device", "dtype"), "packages": None, "pytest_plugins": ()}
_SELECTION_TYPES = {"args": list, "paths": list, "keyword": str, "markexpr": str, "last_failed": bool,
                    "failed_first": bool, "deselect": list, "ignore": list, "stepwise": bool, "maxfail": int,
                    "interrupted": bool, "stopped": str, "deselected": dict, "not_reached": dict, "declared_features": list, "suite": dict, "shards": int}


def _expect(value: Any, types: Any, where: str, what: str) -> None:
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and types is not bool)):
        raise ReportFormatError(f"{where}: expected {what}, got {value!r:.80}")


def check_environment(env: Any, where: str) -> None:
    """The environment's fields that reports render have the JSON types they are read as."""
    _expect(env, dict, f"{where}: environment", "an object")
    for key in _ENV_TEXT:
        _expect((env or {}).get(key), str, f"{where}: environment.{key}", "a string")
    for key, text_fields in _ENV_OBJECTS.items():
        sub = (env or {}).get(key)
        _expect(sub, dict, f"{where}: environment.{key}", "an object")
        names = list(sub or {}) if text_fields is None else text_fields
        for name in names:
            _expect((sub or {}).get(name), str, f"{where}: environment.{key}.{name}", "a string")
    engine = (env or {}).get("engine") or {}
    _expect(engine.get("args"), dict, f"{where}: environment.engine.args", "an object")
    plugins = (env or {}).get("pytest_plugins") or {}
    _expect(plugins.get("loaded"), list, f"{where}: environment.pytest_plugins.loaded", "a list")


def check_selection(selection: Any, where: str) -> None:
    _expect(selection, dict, f"{where}: selection", "an object")
    for key, types in _SELECTION_TYPES.items():
        value = (selection or {}).get(key)
        _expect(value, types, f"{where}: selection.{key}", types.__name__)
    for key in ("args", "paths", "deselect", "ignore", "declared_features"):
        if any(not isinstance(v, str) for v in (selection or {}).get(key) or ()):
            raise ReportFormatError(f"{where}: selection.{key}: expected a list of strings")
    suite = (selection or {}).get("suite") or {}
    _expect(suite.get("files"), dict, f"{where}: selection.suite.files", "an object")
    for key in ("sha256", "version"):
        _expect(suite.get(key), str, f"{where}: selection.suite.{key}", "a string")
    if any(not isinstance(v, str) for v in ((selection or {}).get("deselected") or {}).values()):
        raise ReportFormatError(f"{where}: selection.deselected: expected node id -> feature id strings")


def check_records(records: Any, where: str) -> list[Record]:
    """The records, checked; a format error names the record and the field."""
    if not isinstance(records, list):
        raise ReportFormatError(f"{where}: 'records' must be a list, got {type(records).__name__}")
    try:
        return as_records(records, f"{where}: records")
    except RecordFormatError as exc:
        raise ReportFormatError(str(exc)) from None


def check_report(data: Any, where: str) -> None:
    """A report in the schema-2 shape: every field a reader uses has its type."""
    if not isinstance(data, dict):
        raise ReportFormatError(f"{where}: expected a report object, got {type(data).__name__}")
    if not isinstance(data.get("records"), list):
        raise ReportFormatError(f"{where}: no 'records' list")
    check_records(data["records"], where)
    check_environment(data.get("environment"), where)
    check_selection(data.get("selection"), where)


def load_report(path: Path, check_digest: bool = True) -> dict[str, Any]:
    """Read and check a report.json: schema, the types of every field a reader uses, and (unless
    ``check_digest`` is False) that it matches its digest. Schema 1 is read by ``legacy.upgrade``."""
    from lora_conformance.fileio import read_report_bytes, report_file

    path = report_file(path)
    try:
        data = json.loads(read_report_bytes(path)[1].decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReportFormatError(f"{path}: cannot read a report: not UTF-8 ({exc.reason} at byte {exc.start})") \
            from None
    except (OSError, ValueError) as exc:
        raise ReportFormatError(f"{path}: cannot read a report: {exc}") from None
    from lora_conformance.report import legacy

    schema = data.get("schema") if isinstance(data, dict) else type(data).__name__
    if schema == legacy.SCHEMA_1:
        data = legacy.upgrade(data, str(path), check_digest)
    elif schema != SCHEMA:
        raise ReportFormatError(f"{path}: expected schema {SCHEMA!r} (or {legacy.SCHEMA_1!r}), got {schema!r}")
    elif check_digest:
        stored = data.get("digest")
        if not isinstance(stored, dict) or not stored.get("sha256"):
            raise ReportDigestError(f"{path}: no digest: cannot tell whether the report was edited; "
                                    "pass --ignore-digest to read it anyway")
        actual = report_digest(data)["sha256"]
        if stored["sha256"] != actual:
            raise ReportDigestError(f"{path}: the report does not match its digest (stored {str(stored['sha256'])[:16]}"
                                    f"..., computed {actual[:16]}...): its environment, selection, records or "
                                    "verdict were edited or damaged after the run; pass --ignore-digest to read it "
                                    "anyway")
    check_report(data, str(path))
    return data


def verdict_core(verdict: Any) -> Any:
    """What a verdict says, without how it explains it: certified, coverage, each feature's status."""
    if not isinstance(verdict, Mapping):
        return None
    summary = verdict.get("summary") if isinstance(verdict.get("summary"), Mapping) else {}
    features = verdict.get("features") if isinstance(verdict.get("features"), Mapping) else {}
    coverage = summary.get("coverage") if isinstance(summary.get("coverage"), Mapping) else None
    return {"certified": summary.get("certified"),
            "complete": None if coverage is None else coverage.get("complete"),
            "features": {k: (v.get("status") if isinstance(v, Mapping) else v) for k, v in features.items()}}


def reverify(report: Mapping[str, Any]) -> tuple[Verdict, bool]:
    """(verdict recomputed from the records and selection, whether the stored one says the same)."""
    verdict = verify(report["records"], report.get("selection"), report.get("certification"))
    return verdict, verdict_core(verdict.as_dict()) == verdict_core(report.get("verdict"))


def status_line(report: Mapping[str, Any], verdict: Verdict) -> str:
    """``LoRA conformance · cpu · 2/2 (partial: 2 of 62 features)``: the badge's words and the status."""
    from lora_conformance.report.badge import badge_text

    label, value = badge_text(verdict, device_type(report))
    return f"{label} · {value} ({verdict.status_text()})"
