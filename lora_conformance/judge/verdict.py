"""Verification: a pure function from execution records (and the run's selection) to a verdict.

A record (``lora_conformance.evidence.Record``) is what the recorder saw of one test: the
outcome of each phase, the xfail reason, the skip reason, the structured not-certified outcome,
the failure and its evidence. The rules that turn records into case and feature statuses live
only here, so a stored report.json re-verifies under today's rules without rerunning anything.

Certified: something was shown to work, nothing was shown to be wrong, and the run ran every
feature the suite declares (``coverage``). A narrowed run is *partial: N of M
features*, never certified. A report that recorded no selection (schema 1) has no coverage and
says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional

from lora_conformance.evidence import Record, as_records
from lora_conformance.features import feature_of

# Feature ids listed at most in a coverage summary.
MAX_LISTED = 200

PASSED, FAILED, ERROR, XFAIL, NOT_CERTIFIED, SKIPPED = (
    "passed", "failed", "error", "xfail", "not certified", "skipped")
STATUSES = (PASSED, FAILED, ERROR, XFAIL, NOT_CERTIFIED, SKIPPED)

# A skip recorded with a structured outcome ({"status": "not certified", "cause": ...}, set by
# lora_conformance.outcomes.not_certified) is "not certified": the engine was not shown to do
# it; a skip without one is a neutral skip (not applicable on this device, ...), whatever its
# text says. (Schema-1 records are given their outcome by report.legacy.)

def record_feature(record: Record) -> tuple[str, str, str]:
    """(suite, feature id, description) of a record: its feature marker where the run recorded
    one, else derived from the node id (older reports, unmarked tests; no description)."""
    feature = record.feature
    if isinstance(feature, Mapping) and isinstance(feature.get("id"), str) and "/" in feature["id"]:
        return feature["id"].split("/", 1)[0], feature["id"], str(feature.get("description") or "")
    suite, fid = feature_of(record.nodeid)
    return suite, fid, ""


def classify(record: "Record | Mapping[str, Any]") -> tuple[str, str]:
    """(status, reason) of one case."""
    if not isinstance(record, Record):
        record = Record.from_dict(record)
    phases = record.phases
    message = record.message or ""
    wasxfail = record.wasxfail
    if phases.get("call") == "failed":
        return FAILED, message
    for when in ("collect", "setup", "teardown"):
        if phases.get(when) == "failed":
            return ERROR, f"error in {when}: {message}".rstrip(": ")
    skipped = "skipped" in (phases.get("setup"), phases.get("call"))
    if wasxfail is not None and skipped:
        return XFAIL, wasxfail
    if skipped:
        reason = record.skip_reason or ""
        outcome = record.outcome
        structured = isinstance(outcome, Mapping) and outcome.get("status") == NOT_CERTIFIED
        return (NOT_CERTIFIED if structured else SKIPPED), reason
    if phases.get("call") == "passed":
        return PASSED, (f"XPASS: {wasxfail}" if wasxfail is not None else "")
    return ERROR, "incomplete: the test did not finish (interrupted or crashed worker)"


def aggregate(statuses: Iterable[str]) -> str:
    """A feature's status from its cases' statuses."""
    seen = set(statuses)
    for status in (FAILED, ERROR, XFAIL, PASSED, NOT_CERTIFIED):
        if status in seen:
            return status
    return SKIPPED


@dataclass
class Case:
    nodeid: str
    suite: str
    feature: str
    status: str
    reason: str
    duration: float = 0.0
    evidence: Optional[dict] = None
    longrepr: Optional[str] = None
    failure: Optional[dict] = None  # {"type", "message"} of the exception behind a failure or an xfail
    cause: Optional[str] = None  # a not-certified case's cause (outcomes.CAUSES), when recorded


@dataclass
class Feature:
    id: str
    suite: str
    status: str
    reason: str
    counts: dict[str, int]
    cases: list[str] = field(default_factory=list)
    description: str = ""


@dataclass
class Verdict:
    cases: list[Case]
    features: dict[str, Feature]
    suites: dict[str, dict[str, int]]  # suite -> case counts per status
    summary: dict[str, Any]
    root_causes: list[Any] = field(default_factory=list)  # root_causes.RootCause, most features first

    @property
    def certified(self) -> bool:
        return self.summary["certified"]

    @property
    def partial(self) -> bool:
        coverage = self.summary.get("coverage")
        return isinstance(coverage, Mapping) and not coverage.get("complete")

    def status_text(self) -> str:
        """``certified``, ``partial: N of M features`` or ``not certified`` (with the partial part
        when both apply); a report without a recorded selection says so."""
        coverage = self.summary.get("coverage")
        by = self.summary["features_by_status"]
        part = (f"partial: {coverage['features_run']} of {coverage['features_declared']} features"
                if self.partial else "")
        if self.certified:
            return "certified" + ("" if coverage is not None else " (selection not recorded)")
        if part and not (by[FAILED] or by[ERROR]):
            return part
        return "not certified" + (f"; {part}" if part else "")

    def score(self) -> tuple[int, int]:
        """(passed features, features that are not 'skipped')."""
        return self.summary["features_passed"], self.summary["features_counted"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "summary": dict(self.summary),
            "suites": {k: dict(v) for k, v in self.suites.items()},
            "features": {k: asdict(v) for k, v in self.features.items()},
            "cases": [asdict(c) for c in self.cases],
            "root_causes": [asdict(r) for r in self.root_causes],
        }


def _counts() -> dict[str, int]:
    return {s: 0 for s in STATUSES}


def verify(records: Iterable["Record | Mapping[str, Any]"],
           selection: Optional[Mapping[str, Any]] = None,
           certification: Optional[Mapping[str, Any]] = None) -> Verdict:
    """The verdict of ``records`` (Records, or their stored form); ``selection`` is what the run
    selected (``selection.describe``), None where it was not recorded; ``certification`` its mode,
    waivers and audit (``lora_conformance.certification``), None for a report from before them."""
    from lora_conformance.judge.root_causes import root_causes

    records = sorted(as_records(records), key=lambda r: r.nodeid)
    cases: list[Case] = []
    descriptions: dict[str, str] = {}
    for rec in records:
        suite, fid, description = record_feature(rec)
        if description:
            descriptions.setdefault(fid, description)
        status, reason = classify(rec)
        outcome = rec.outcome or {}
        cases.append(Case(rec.nodeid, suite, fid, status, reason, rec.duration, rec.evidence, rec.longrepr,
                          dict(rec.failure) if rec.failure else None,
                          outcome.get("cause") if status == NOT_CERTIFIED else None))
    features: dict[str, Feature] = {}
    suites: dict[str, dict[str, int]] = {}
    for case in cases:
        feat = features.setdefault(case.feature, Feature(case.feature, case.suite, "", "", _counts(),
                                                         description=descriptions.get(case.feature, "")))
        feat.counts[case.status] += 1
        feat.cases.append(case.nodeid)
        suites.setdefault(case.suite, _counts())[case.status] += 1
    for feat in features.values():
        feat.status = aggregate(s for s, n in feat.counts.items() if n)
        # The reason shown for a feature is that of its first case with the feature's status.
        feat.reason = next((c.reason for c in cases if c.feature == feat.id and c.status == feat.status), "")
    by_status = _counts()
    for feat in features.values():
        by_status[feat.status] += 1
    case_counts = _counts()
    for case in cases:
        case_counts[case.status] += 1
    counted = len(features) - by_status[SKIPPED]
    covered = coverage(records, selection)
    summary = {
        "features": len(features),
        "features_by_status": by_status,
        "features_passed": by_status[PASSED],
        "features_counted": counted,
        "cases": len(cases),
        "cases_by_status": case_counts,
        # Certified: something was shown to work, nothing was shown to be wrong, and nothing
        # the suite declares was left out (where the selection was recorded).
        "certified": (by_status[PASSED] > 0 and by_status[FAILED] == 0 and by_status[ERROR] == 0
                      and (covered is None or covered["complete"])),
        "coverage": covered,
    }
    if certification is not None:
        summary["certification"] = certification_summary(certification)
        summary["certified"] = summary["certified"] and summary["certification"]["holds"]
    causes = root_causes(cases)
    summary["root_causes"] = len(causes)
    return Verdict(cases, dict(sorted(features.items())), dict(sorted(suites.items())), summary, causes)


def coverage(records: Iterable[Any], selection: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """``{"complete", "features_run", "features_declared", "not_run": [ids], "deselected_cases",
    "not_reached_cases"}``, or None where no selection was recorded. A feature *ran* when it has
    records and none of its collected cases was left out (deselected, or selected and never reached:
    an interrupt, or pytest-xdist's stop after crashed workers); declared features are the suite's
    and every feature the run saw."""
    if not isinstance(selection, Mapping):
        return None
    recorded: dict[str, str] = {}
    for rec in records:
        recorded[rec.nodeid] = record_feature(rec)[1]
    deselected = {str(k): str(v) for k, v in (selection.get("deselected") or {}).items()}
    unreached = {str(k): str(v) for k, v in (selection.get("not_reached") or {}).items() if str(k) not in recorded}
    left_out = {fid for nodeid, fid in deselected.items() if nodeid not in recorded} | set(unreached.values())
    seen = set(recorded.values())
    declared = set(selection.get("declared_features") or ()) | seen | set(deselected.values()) | set(unreached.values())
    ran = (seen - left_out) & declared
    not_run = sorted(declared - ran)
    return {"complete": not not_run, "features_run": len(ran), "features_declared": len(declared),
            "not_run": not_run[:MAX_LISTED], "deselected_cases": sum(1 for n in deselected if n not in recorded),
            "not_reached_cases": len(unreached)}


def certification_summary(certification: Mapping[str, Any]) -> dict[str, Any]:
    """What the run's mode, waivers and audit mean for the verdict: in a certified run every waiver
    recorded against another suite version must have been re-confirmed (it ran and still failed);
    in any run, an audited case that gave other outputs on a fresh engine in another batch order
    (non-determinism or stale state) keeps the run from being certified."""
    waived = list(certification.get("waived") or ())
    certified_mode = certification.get("mode") == "certified"
    not_reconfirmed = sorted(w["nodeid"] for w in waived if certified_mode and w.get("stale") and not w.get("reconfirmed"))
    audit = certification.get("audit") or {}
    mismatches = list(audit.get("mismatches") or ())
    return {"mode": certification.get("mode") or "open", "suite_version": certification.get("suite_version"),
            "waived_features": len({w["feature"] for w in waived}), "waived_cases": len(waived),
            "not_reconfirmed": not_reconfirmed[:MAX_LISTED], "audit_sampled": int(audit.get("sampled") or 0),
            "audit_mismatches": len(mismatches), "holds": not not_reconfirmed and not mismatches}
