"""Reading schema-1 reports (``lora-conformance/report/1``): the one place that knows the old form.

What schema 1 lacked, and how its records are read today:

- no ``selection``: the run's coverage is unknown (``None``), and readers say so;
- its ``records_digest`` covers the records only (not the environment): it is checked here, and
  readers say that the environment is covered by no digest;
- records written before outcomes were structured (no ``outcome`` key) tell a not-certified
  skip by its text: a reason saying the engine lacks a capability, or starting with
  ``not certified:`` (pytest writes a skip subclass's reason as ``<module>.NotCertified: ...``);
- records without ``failure`` carry the exception type in their message (``Type: text``);
- ``repro`` was a field that no run ever filled: dropped.

``upgrade(data, where)`` returns the report in the schema-2 shape (without a digest); every
other module reads only that shape.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable, Mapping

SCHEMA_1 = "lora-conformance/report/1"
NOT_CERTIFIED_MARKER = "engine does not declare"
_NOT_CERTIFIED_REASON = re.compile(r"^(?:[\w.]*NotCertified: )?not certified:")
_TYPED_MESSAGE = re.compile(r"^([A-Za-z_]\w*(?:Error|Exception|Failure|Exit|Interrupt)): (.*)$", re.S)
_DROPPED = ("repro",)


def records_digest(records: Iterable[Mapping[str, Any]]) -> str:
    """Schema 1's checksum: sha256 over the records as JSON with sorted keys and no whitespace."""
    canonical = json.dumps(json.loads(json.dumps(list(records), default=str)), sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def upgrade_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A schema-1 record in today's form (unchecked: ``evidence.Record.from_dict`` checks it)."""
    rec = {k: v for k, v in record.items() if k not in _DROPPED}
    if "outcome" not in rec:
        reason = rec.get("skip_reason")
        skipped = "skipped" in ((rec.get("phases") or {}).get("setup"), (rec.get("phases") or {}).get("call"))
        if skipped and isinstance(reason, str) and rec.get("wasxfail") is None and (
                NOT_CERTIFIED_MARKER in reason or _NOT_CERTIFIED_REASON.match(reason)):
            rec["outcome"] = {"status": "not certified", "cause": None, "detail": reason}
        else:
            rec["outcome"] = None
    if "failure" not in rec:
        typed = _TYPED_MESSAGE.match(rec["message"]) if isinstance(rec.get("message"), str) else None
        rec["failure"] = {"type": typed.group(1), "message": typed.group(2)} if typed else None
    return rec


def upgrade(data: Mapping[str, Any], where: str, check_digest: bool = True) -> dict[str, Any]:
    """A schema-1 report as a schema-2 one (``selection`` None, ``legacy`` describing what is not
    covered). Raises ``document.ReportDigestError`` when the records do not match their checksum."""
    from lora_conformance.errors import ReportDigestError, ReportFormatError

    records = data.get("records")
    if not isinstance(records, list):
        raise ReportFormatError(f"{where}: no 'records' list")
    if check_digest:
        stored = data.get("records_digest")
        if stored is None:
            raise ReportDigestError(f"{where}: no records_digest: cannot tell whether its records were edited "
                                    "(written before digests, or stripped); pass --ignore-digest to read it anyway")
        actual = records_digest(records)
        if stored != actual:
            raise ReportDigestError(f"{where}: records do not match records_digest (stored {str(stored)[:16]}..., "
                                    f"computed {actual[:16]}...): the records were edited or damaged after the "
                                    "run; pass --ignore-digest to read it anyway")
    upgraded = [upgrade_record(r) if isinstance(r, Mapping) else r for r in records]
    return {
        "schema": SCHEMA_1,
        "environment": data.get("environment"),
        "selection": None,
        "records": upgraded,
        "verdict": data.get("verdict"),
        "legacy": {"schema": 1, "digest_covers": "records" if check_digest else "nothing (not checked)"},
    }
