"""Evidence as data: what a test leaves for the report, and the record the report keeps of it.

The data path: a test (and the plugin's ``pytest_runtest_makereport``, the one writer,
``attach_call_facts``) attaches *properties* to the test's ``user_properties``; pytest-xdist
carries them from workers to the controller, where ``report.recorder`` folds each test's
reports into one ``Record``; ``report.verify`` turns records into a verdict and
``report.document`` stores them in report.json.

Property values are JSON strings (they cross processes); the names are below and nowhere
else. ``Record`` is the one shape of a record, in memory and in report.json (schema 2);
``Record.from_dict`` checks a stored record field by field. Reports of the older schema are
converted by ``report.legacy``, not here.

Imports nothing heavy: the plugin module imports this at start-up.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping, Optional

# ---- property names (user_properties keys) --------------------------------------------------

FEATURE = "lora_feature"  # {"id", "description"}: the test's feature marker
OUTCOME = "lora_outcome"  # {"status": "not certified", "cause", "detail"}: outcomes.NotCertified
FAILURE = "lora_failure"  # {"type", "message"}: the exception that failed (or xfailed) the test
EVIDENCE = "lora_evidence"  # a ConformanceAssertionError's ``.evidence`` (check, summary, rows, hypothesis)
EFFECTS = "lora_effects"  # [compare.effects analyses]: the paired effect verdict's numbers (harness)
NOTE = "lora_note"  # text: what a passing test could not establish (context.TestContext.note)
# [{"engine", "seconds", "why"}]: the engines this test started (harness.Harness.take_starts)
ENGINE_STARTS = "lora_engine_starts"
PROPERTIES = (FEATURE, OUTCOME, FAILURE, EVIDENCE, EFFECTS, NOTE, ENGINE_STARTS)

MAX_FAILURE_MESSAGE = 2000


class RecordFormatError(ValueError):
    """A stored record that is not a record (the message names the record and the field)."""


def add(item: Any, name: str, value: Any) -> None:
    """Attach property ``name`` to a test item (``value`` JSON-encoded unless it is text)."""
    if name not in PROPERTIES:
        raise ValueError(f"unknown evidence property {name!r}; expected one of {', '.join(PROPERTIES)}")
    item.user_properties.append((name, value if isinstance(value, str) and name == NOTE
                                 else json.dumps(value, default=str)))


def values(report: Any, name: str) -> list[Any]:
    """The raw values of property ``name`` on a test item or report, in order."""
    return [p[1] for p in getattr(report, "user_properties", None) or ()
            if isinstance(p, (tuple, list)) and len(p) == 2 and p[0] == name]


def _decoded(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def first_object(report: Any, name: str) -> Optional[dict]:
    """The first value of ``name`` that decodes to a JSON object."""
    for value in values(report, name):
        decoded = _decoded(value)
        if isinstance(decoded, dict):
            return decoded
    return None


def all_list_items(report: Any, name: str) -> Optional[list]:
    """The objects of every value of ``name`` that decodes to a JSON list, concatenated (None: none)."""
    out: list = []
    for value in values(report, name):
        decoded = _decoded(value)
        if isinstance(decoded, list):
            out += [x for x in decoded if isinstance(x, dict)]
    return out or None


def failure_facts(exc: BaseException) -> dict[str, str]:
    """What the report groups failures by: the exception's type and its message (bounded)."""
    return {"type": type(exc).__name__, "message": str(exc)[:MAX_FAILURE_MESSAGE]}


def attach_call_facts(item: Any, excinfo: Any) -> None:
    """The one writer of a phase's structured facts: the feature marker (once per test), and for a
    raised exception either the not-certified outcome or the failure's type and message, plus a
    comparison's evidence. Called by the plugin's ``pytest_runtest_makereport`` before pytest
    builds the report (whose ``user_properties`` is the item's list)."""
    import pytest

    from lora_conformance.features import FeatureMarkerError, feature_of_item
    from lora_conformance.outcomes import NotCertified

    present = {p[0] for p in item.user_properties if isinstance(p, (tuple, list)) and len(p) == 2}
    if FEATURE not in present:
        try:
            feature = feature_of_item(item)
        except FeatureMarkerError:
            feature = None  # reported as a usage error at collection
        if feature is not None:
            add(item, FEATURE, {"id": feature.id, "description": feature.description})
    if excinfo is None:
        return
    exc = excinfo.value
    if isinstance(exc, NotCertified):
        if OUTCOME not in present:
            add(item, OUTCOME, exc.as_dict())
        return
    if isinstance(exc, pytest.skip.Exception):
        return
    if FAILURE not in present:
        add(item, FAILURE, failure_facts(exc))
    evidence = getattr(exc, "evidence", None)
    if isinstance(evidence, dict) and EVIDENCE not in present:
        add(item, EVIDENCE, evidence)


# ---- the record -------------------------------------------------------------------------------

PHASES = ("collect", "setup", "call", "teardown")
PHASE_OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class Record:
    """What the report keeps of one test (one node id), over its phases."""

    nodeid: str
    phases: dict[str, str] = field(default_factory=dict)  # phase -> passed | failed | skipped
    duration: float = 0.0  # seconds, all phases
    wasxfail: Optional[str] = None  # the xfail reason, for an xfailed (or xpassed) test
    skip_reason: Optional[str] = None
    message: Optional[str] = None  # the first failure's one-line message
    longrepr: Optional[str] = None  # its traceback text (bounded)
    feature: Optional[dict] = None  # FEATURE
    outcome: Optional[dict] = None  # OUTCOME: a not-certified skip (None: a neutral skip, or no skip)
    failure: Optional[dict] = None  # FAILURE
    evidence: Optional[dict] = None  # EVIDENCE
    effects: Optional[list] = None  # EFFECTS
    notes: Optional[list] = None  # NOTE values
    engine_starts: Optional[list] = None  # ENGINE_STARTS, every phase's
    started: Optional[float] = None  # seconds from the run's start to its setup's start
    worker: Optional[str] = None  # the pytest-xdist worker that ran it ("main": a run of one process)
    # bytes its process held in tensors on the accelerator at most while it ran, its shared engines
    # included (torch's allocator, its peak reset after every test); None on cpu
    device_peak: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> "Record":
        """A record from its stored form; a ``RecordFormatError`` names ``where`` and the field."""
        if not isinstance(data, Mapping):
            raise RecordFormatError(f"{where}: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(FIELD_TYPES))
        if unknown:
            raise RecordFormatError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; "
                                    f"expected {', '.join(FIELD_TYPES)}")
        for name, types in FIELD_TYPES.items():
            value = data.get(name)
            if value is None and name not in ("nodeid", "phases"):
                continue
            if not isinstance(value, types) or isinstance(value, bool):
                raise RecordFormatError(f"{where}.{name}: expected {' or '.join(t.__name__ for t in types)}, "
                                        f"got {value!r:.80}")
        if not data["nodeid"]:
            raise RecordFormatError(f"{where}.nodeid: empty")
        for when, outcome in data["phases"].items():
            if when not in PHASES or outcome not in PHASE_OUTCOMES:
                raise RecordFormatError(f"{where}.phases: {when!r}: {outcome!r}; expected phases "
                                        f"{', '.join(PHASES)} with outcomes {', '.join(PHASE_OUTCOMES)}")
        if data.get("duration") is not None and not math.isfinite(data["duration"]):
            raise RecordFormatError(f"{where}.duration: {data['duration']!r} is not a finite number")
        for name in ("feature", "outcome", "failure"):
            value = data.get(name)
            bad = [k for k, v in (value or {}).items() if v is not None and not isinstance(v, str)]
            if bad:
                raise RecordFormatError(f"{where}.{name}.{bad[0]}: expected a string, got {value[bad[0]]!r:.80}")
        if data.get("feature") is not None and not isinstance(data["feature"].get("id"), str):
            raise RecordFormatError(f"{where}.feature.id: expected a string (suite/name)")
        if any(not isinstance(n, str) for n in data.get("notes") or ()):
            raise RecordFormatError(f"{where}.notes: expected a list of strings")
        for name in ("effects", "engine_starts"):
            if any(not isinstance(a, Mapping) for a in data.get(name) or ()):
                raise RecordFormatError(f"{where}.{name}: expected a list of objects")
        kwargs = {name: data.get(name) for name in FIELD_TYPES}
        kwargs["phases"] = dict(data["phases"])
        kwargs["duration"] = float(data.get("duration") or 0.0)
        return cls(**kwargs)


# field -> the JSON types it may hold (None allowed for all but nodeid and phases)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "nodeid": (str,), "phases": (dict,), "duration": (int, float), "wasxfail": (str,), "skip_reason": (str,),
    "message": (str,), "longrepr": (str,), "feature": (dict,), "outcome": (dict,), "failure": (dict,),
    "evidence": (dict,), "effects": (list,), "notes": (list,), "engine_starts": (list,),
    "started": (int, float), "worker": (str,), "device_peak": (int,),
}
assert list(FIELD_TYPES) == [f.name for f in fields(Record)], "FIELD_TYPES must list Record's fields in order"


def as_records(items: Iterable[Any], where: str = "records") -> list[Record]:
    """Records from Record objects or their stored forms (checked)."""
    return [r if isinstance(r, Record) else Record.from_dict(r, f"{where}[{i}]") for i, r in enumerate(items)]
