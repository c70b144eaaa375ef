"""Verification: a pure function from execution records to a verdict.

A record is what the recorder saw of one test (plain JSON, see ``recorder``): the outcome
of each phase, the xfail reason, the skip reason, the failure message and evidence. The
rules that turn records into case and feature statuses live only here, so an old
report.json re-verifies under today's rules without rerunning anything.
"""

from __future__ import annotations

import re

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional

PASSED, FAILED, ERROR, XFAIL, NOT_CERTIFIED, SKIPPED = (
    "passed", "failed", "error", "xfail", "not certified", "skipped")
STATUSES = (PASSED, FAILED, ERROR, XFAIL, NOT_CERTIFIED, SKIPPED)

# A skip recorded with a structured outcome ({"status": "not certified", "cause": ...}, set by
# lora_conformance.outcomes.not_certified) is "not certified": the engine was not shown to do
# it; a record with an empty outcome is a neutral skip (not applicable on this device, ...),
# whatever its text says. Records written before outcomes were recorded (no "outcome" key)
# fall back to the skip text: a reason that says the engine lacks a capability, or starts
# with "not certified:".
NOT_CERTIFIED_MARKER = "engine does not declare"
_NOT_CERTIFIED_REASON = re.compile(r"^(?:[\w.]*NotCertified: )?not certified:")

COLLECTION = "(collection)"


def record_feature(record: Mapping[str, Any]) -> tuple[str, str, str]:
    """(suite, feature id, description) of a record: its feature marker where the run recorded
    one, else derived from the node id (older reports, unmarked tests; no description)."""
    feature = record.get("feature")
    if isinstance(feature, Mapping) and isinstance(feature.get("id"), str) and "/" in feature["id"]:
        return feature["id"].split("/", 1)[0], feature["id"], str(feature.get("description") or "")
    suite, fid = feature_of(record["nodeid"])
    return suite, fid, ""


def feature_of(nodeid: str) -> tuple[str, str]:
    """(suite, feature id) of a test id.

    ``suites/test_mixed_batch.py::test_nearest_reference_routing[cpu-float32]`` ->
    ``("mixed_batch", "mixed_batch/nearest_reference_routing")``. Parameters and classes
    are dropped: a feature is the test function, its cases are the parametrizations.
    """
    path, _, rest = nodeid.partition("::")
    stem = path.rsplit("/", 1)[-1]
    stem = stem[:-3] if stem.endswith(".py") else stem
    suite = stem[5:] if stem.startswith("test_") else stem
    if not rest:
        return suite, f"{suite}/{COLLECTION}"
    function = rest.split("[", 1)[0].rsplit("::", 1)[-1]
    function = function[5:] if function.startswith("test_") else function
    return suite, f"{suite}/{function}"


def classify(record: Mapping[str, Any]) -> tuple[str, str]:
    """(status, reason) of one case."""
    phases: Mapping[str, str] = record.get("phases") or {}
    message = record.get("message") or ""
    wasxfail = record.get("wasxfail")
    if phases.get("call") == "failed":
        return FAILED, message
    for when in ("collect", "setup", "teardown"):
        if phases.get(when) == "failed":
            return ERROR, f"error in {when}: {message}".rstrip(": ")
    skipped = "skipped" in (phases.get("setup"), phases.get("call"))
    if wasxfail is not None and skipped:
        return XFAIL, wasxfail
    if skipped:
        reason = record.get("skip_reason") or ""
        if "outcome" in record:  # recorded structurally: the outcome decides, not the text
            outcome = record["outcome"]
            structured = isinstance(outcome, Mapping) and outcome.get("status") == NOT_CERTIFIED
            return (NOT_CERTIFIED if structured else SKIPPED), reason
        # pytest writes a skip subclass's reason as "<module>.NotCertified: not certified: ..."
        not_certified = NOT_CERTIFIED_MARKER in reason or _NOT_CERTIFIED_REASON.match(reason) is not None
        return (NOT_CERTIFIED if not_certified else SKIPPED), reason
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
    repro: Optional[str] = None
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


def verify(records: Iterable[Mapping[str, Any]]) -> Verdict:
    from lora_conformance.report.root_causes import root_causes

    cases: list[Case] = []
    descriptions: dict[str, str] = {}
    for rec in sorted(records, key=lambda r: r["nodeid"]):
        suite, fid, description = record_feature(rec)
        if description:
            descriptions.setdefault(fid, description)
        status, reason = classify(rec)
        outcome = rec.get("outcome") if isinstance(rec.get("outcome"), Mapping) else {}
        failure = rec.get("failure") if isinstance(rec.get("failure"), Mapping) else None
        cases.append(Case(rec["nodeid"], suite, fid, status, reason, float(rec.get("duration") or 0.0),
                          rec.get("evidence"), rec.get("repro"), rec.get("longrepr"),
                          dict(failure) if failure else None,
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
    summary = {
        "features": len(features),
        "features_by_status": by_status,
        "features_passed": by_status[PASSED],
        "features_counted": counted,
        "cases": len(cases),
        "cases_by_status": case_counts,
        # Certified: something was shown to work and nothing was shown to be wrong.
        "certified": by_status[PASSED] > 0 and by_status[FAILED] == 0 and by_status[ERROR] == 0,
    }
    causes = root_causes(cases)
    summary["root_causes"] = len(causes)
    return Verdict(cases, dict(sorted(features.items())), dict(sorted(suites.items())), summary, causes)
