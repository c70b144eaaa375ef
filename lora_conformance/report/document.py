"""report.json: build, write (with report.md, report.html, badge.svg beside it), load.

report.json keeps the execution records *and* the verdict derived from them; readers that
re-verify (``report render``, ``report merge``, ``report verify``) recompute the verdict from
the records. ``records_digest`` (sha256 over the records' canonical JSON) makes an edit of the
records evident: readers refuse a report whose records do not match it, unless told to ignore
it. It is a checksum written by the run, not a signature: it catches an edited or damaged file,
not someone who recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from lora_conformance.report.verify import Verdict, verify

SCHEMA = "lora-conformance/report/1"


class ReportFormatError(ValueError):
    pass


class ReportDigestError(ReportFormatError):
    """The records do not match the report's records_digest (edited, damaged, or no digest)."""


# record field -> the JSON types it may hold (None allowed for all but nodeid and phases)
RECORD_FIELDS = {"nodeid": (str,), "phases": (dict,), "wasxfail": (str,), "skip_reason": (str,), "message": (str,),
                 "evidence": (dict,), "repro": (str,), "longrepr": (str,), "duration": (int, float),
                 "effects": (list,), "notes": (list,)}
PHASES = ("collect", "setup", "call", "teardown")
OUTCOMES = ("passed", "failed", "skipped")


def records_digest(records: Iterable[Mapping[str, Any]]) -> str:
    """sha256 over the records as JSON with sorted keys and no whitespace (what they are on disk)."""
    canonical = json.dumps(json.loads(json.dumps(list(records), default=str)), sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def check_records(records: Any, where: str) -> None:
    """A format error naming the record and the field, instead of a traceback in verify()."""
    if not isinstance(records, list):
        raise ReportFormatError(f"{where}: 'records' must be a list, got {type(records).__name__}")
    for i, rec in enumerate(records):
        at = f"{where}: records[{i}]"
        if not isinstance(rec, dict):
            raise ReportFormatError(f"{at}: expected an object, got {type(rec).__name__}")
        for field, types in RECORD_FIELDS.items():
            value = rec.get(field)
            if value is None and field not in ("nodeid", "phases"):
                continue
            if not isinstance(value, types) or isinstance(value, bool):
                raise ReportFormatError(f"{at}.{field}: expected {' or '.join(t.__name__ for t in types)}, "
                                        f"got {value!r:.80}")
        if not rec["nodeid"]:
            raise ReportFormatError(f"{at}.nodeid: empty")
        for when, outcome in rec["phases"].items():
            if when not in PHASES or outcome not in OUTCOMES:
                raise ReportFormatError(f"{at}.phases: {when!r}: {outcome!r}; expected phases {', '.join(PHASES)} "
                                        f"with outcomes {', '.join(OUTCOMES)}")
        if rec.get("duration") is not None and not math.isfinite(rec["duration"]):
            raise ReportFormatError(f"{at}.duration: {rec['duration']!r} is not a finite number")


def build_report(environment: Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    records = sorted((dict(r) for r in records), key=lambda r: r["nodeid"])
    verdict = verify(records)
    return {
        "schema": SCHEMA,
        "environment": dict(environment),
        "verdict": verdict.as_dict(),
        "records": records,
        "records_digest": records_digest(records),
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
    report = {**report, "verdict": verdict.as_dict(), "records_digest": records_digest(report["records"])}
    paths = {name: out_dir / name for name in ("report.json", "report.md", "report.html", "badge.svg")}
    paths["report.json"].write_text(json.dumps(report, indent=1, sort_keys=False, default=str) + "\n",
                                    encoding="utf-8")
    paths["report.md"].write_text(render_markdown(report, verdict), encoding="utf-8")
    paths["report.html"].write_text(render_html(report, verdict), encoding="utf-8")
    paths["badge.svg"].write_text(badge_svg(verdict, device_type(report)), encoding="utf-8")
    return paths


def load_report(path: Path, check_digest: bool = True) -> dict[str, Any]:
    """Read and check a report.json: schema, every record's fields, and (unless ``check_digest``
    is False) that the records match ``records_digest``."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReportFormatError(f"{path}: cannot read a report: not UTF-8 ({exc.reason} at byte {exc.start})") \
            from None
    except (OSError, ValueError) as exc:
        raise ReportFormatError(f"{path}: cannot read a report: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportFormatError(f"{path}: expected schema {SCHEMA!r}, got {got!r}")
    if not isinstance(data.get("records"), list):
        raise ReportFormatError(f"{path}: no 'records' list")
    check_records(data["records"], str(path))
    if data.get("environment") is not None and not isinstance(data["environment"], dict):
        raise ReportFormatError(f"{path}: 'environment' must be an object")
    if check_digest:
        stored, actual = data.get("records_digest"), records_digest(data["records"])
        if stored is None:
            raise ReportDigestError(f"{path}: no records_digest: cannot tell whether its records were edited "
                                    "(written before digests, or stripped); pass --ignore-digest to read it anyway")
        if stored != actual:
            raise ReportDigestError(f"{path}: records do not match records_digest (stored {str(stored)[:16]}..., "
                                    f"computed {actual[:16]}...): the records were edited or damaged after the run; "
                                    "pass --ignore-digest to read it anyway")
    return data


def reverify(report: Mapping[str, Any]) -> tuple[Verdict, bool]:
    """(verdict recomputed from the records, whether it equals the stored one)."""
    verdict = verify(report["records"])
    return verdict, verdict.as_dict() == report.get("verdict")
