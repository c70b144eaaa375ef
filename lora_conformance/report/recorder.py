"""Execution side of the report: record every test's outcome, write the report at the end.

Register ``ReportRecorder(settings, report_dir)`` as a plugin (on the controller and on
xdist workers alike). What it reads from each ``TestReport`` is what pytest-xdist carries
from workers to the controller:

- ``nodeid``, ``when``, ``outcome``, ``duration``, ``wasxfail`` (xfail reason),
- the skip reason (``longrepr`` = ``(path, line, "Skipped: reason")``),
- for failures, ``longrepr.reprcrash.message`` and ``longreprtext``,
- ``user_properties`` entries ``("lora_evidence", json_string)`` (a ConformanceAssertionError's
  ``.evidence``) and, optionally, ``("lora_repro", text)`` (a small reproduction);
- the structured facts the lora-conformance plugin sets (``lora_conformance.outcomes``):
  ``lora_feature`` (the feature marker's id and description), ``lora_outcome`` (a not-certified
  skip's cause and detail), ``lora_failure`` (type and message of the exception behind a
  failure or an xfail). Records keep them as ``feature``, ``outcome`` and ``failure``; reports
  written before they existed lack those keys and verify by the node id and skip text.

The recorder itself adds ``("lora_evidence", ...)`` in ``pytest_runtest_makereport`` when the
test raised a ConformanceAssertionError and no fixture did already. On xdist workers it only
does that; the controller records and writes. Verification is ``verify.verify``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest

from lora_conformance.outcomes import FAILURE_PROPERTY, FEATURE_PROPERTY, OUTCOME_PROPERTY
from lora_conformance.report.verify import feature_of

# The plugin may put environment facts that need torch or the engine here (deep-merged over
# what the recorder computes): {"engine": {"version": ..., "capabilities": [...]},
# "device": {"device_name": ..., "driver": ...}, ...}.
ENV_KEY = pytest.StashKey[dict]()
EVIDENCE_PROPERTY = "lora_evidence"
REPRO_PROPERTY = "lora_repro"
EFFECTS_PROPERTY = "lora_effects"  # JSON list of compare.effects analyses (harness.assert_conforms)
NOTE_PROPERTY = "lora_note"  # what a test could not establish (harness.TestContext.note)
MAX_TEXT = 8000


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, (tuple, list)) and len(lr) == 3:
        text = str(lr[2])
    else:
        text = str(lr or "")
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def _failure_message(report) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    message = getattr(crash, "message", None)
    if not message:
        text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
        message = text.strip().splitlines()[-1] if text.strip() else "failed"
    # "pkg.mod.SomeError: text" -> "SomeError: text": the module path is noise in a table.
    message = re.sub(r"^(?:[A-Za-z_][\w]*\.)+(?=[A-Za-z_]\w*:)", "", message)
    return message[:MAX_TEXT]


def _properties(report, name: str) -> list[Any]:
    out = []
    for prop in getattr(report, "user_properties", None) or ():
        if isinstance(prop, (tuple, list)) and len(prop) == 2 and prop[0] == name:
            out.append(prop[1])
    return out


def _evidence(report, name: str = EVIDENCE_PROPERTY) -> Optional[dict]:
    for value in _properties(report, name):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError):
            continue
        if isinstance(parsed, dict):
            return parsed
    return None


def _effects(report) -> Optional[list]:
    """The paired effect analyses a test recorded (``lora_effects``: harness.assert_conforms)."""
    out: list = []
    for value in _properties(report, EFFECTS_PROPERTY):
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            continue
        if isinstance(parsed, list):
            out += [a for a in parsed if isinstance(a, dict)]
    return out or None


class ReportRecorder:
    def __init__(self, settings: Any, report_dir: "str | Path"):
        self.settings = settings
        self.report_dir = Path(report_dir)
        self.records: dict[str, dict[str, Any]] = {}
        self.written: dict[str, Path] = {}
        self.verdict = None
        self.config: Optional[pytest.Config] = None

    # ---- execution: what happened ---------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        exc = call.excinfo.value if call.excinfo is not None else None
        # What the lora-conformance plugin records on every process (xdist workers too); added
        # here when it did not (the recorder used on its own). A fresh list each time:
        # report.user_properties is item.user_properties itself.
        from lora_conformance.outcomes import NotCertified, failure_facts

        extra = []
        evidence = getattr(exc, "evidence", None)
        if isinstance(evidence, dict) and not _properties(report, EVIDENCE_PROPERTY):
            extra.append((EVIDENCE_PROPERTY, json.dumps(evidence, default=str)))
        if isinstance(exc, NotCertified) and not _properties(report, OUTCOME_PROPERTY):
            extra.append((OUTCOME_PROPERTY, json.dumps(exc.as_dict())))
        elif exc is not None and not isinstance(exc, pytest.skip.Exception) \
                and not _properties(report, FAILURE_PROPERTY):
            extra.append((FAILURE_PROPERTY, json.dumps(failure_facts(exc), default=str)))
        if extra:
            report.user_properties = list(report.user_properties) + extra

    def _record(self, nodeid: str) -> dict[str, Any]:
        return self.records.setdefault(nodeid, {
            "nodeid": nodeid, "phases": {}, "wasxfail": None, "skip_reason": None, "message": None,
            "evidence": None, "repro": None, "longrepr": None, "duration": 0.0,
            "feature": None, "outcome": None, "failure": None, "effects": None, "notes": None,
        })

    def pytest_runtest_logreport(self, report):
        if self.config is not None and _is_worker(self.config):
            return
        rec = self._record(report.nodeid)
        rec["phases"][report.when] = report.outcome
        rec["duration"] = round(rec["duration"] + float(report.duration or 0.0), 6)
        if getattr(report, "wasxfail", None) is not None:
            rec["wasxfail"] = str(report.wasxfail)
        rec["feature"] = rec["feature"] or _evidence(report, FEATURE_PROPERTY)
        if report.when == "call":
            rec["effects"] = rec["effects"] or _effects(report)
            rec["notes"] = rec["notes"] or ([str(n) for n in _properties(report, NOTE_PROPERTY)] or None)
        if report.skipped and rec["skip_reason"] is None:
            rec["skip_reason"] = _skip_reason(report)
            rec["outcome"] = _evidence(report, OUTCOME_PROPERTY)
        if report.failed or getattr(report, "wasxfail", None) is not None:
            rec["failure"] = rec["failure"] or _evidence(report, FAILURE_PROPERTY)
            # An xfail's evidence too: its nearest hypothesis groups it with the failures of its bug.
            rec["evidence"] = rec["evidence"] or _evidence(report)
        if report.failed:
            if rec["message"] is None:  # the first failure is the cause; a teardown error follows it
                rec["message"] = _failure_message(report)
                rec["longrepr"] = (getattr(report, "longreprtext", "") or "")[-MAX_TEXT:] or None
            rec["evidence"] = rec["evidence"] or _evidence(report)
            repro = _properties(report, REPRO_PROPERTY)
            rec["repro"] = rec["repro"] or (str(repro[0]) if repro else None)

    def pytest_collectreport(self, report):
        if report.failed and (self.config is None or not _is_worker(self.config)):
            rec = self._record(report.nodeid or "(session)")
            rec["phases"]["collect"] = "failed"
            rec["message"] = _failure_message(report)
            rec["longrepr"] = (getattr(report, "longreprtext", "") or "")[-MAX_TEXT:] or None

    # ---- session ---------------------------------------------------------------------

    def pytest_sessionstart(self, session):
        self.config = session.config
        if not self.report_dir.is_absolute():
            self.report_dir = Path(session.config.invocation_params.dir) / self.report_dir

    def environment(self, config: Optional[pytest.Config]) -> dict[str, Any]:
        from lora_conformance.report.environment import fingerprint, pytest_plugins

        if config is None:
            return fingerprint(self.settings)
        return fingerprint(self.settings, {**config.stash.get(ENV_KEY, {}), "pytest_plugins": pytest_plugins(config)})

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        config = session.config
        self.config = config
        if _is_worker(config):
            return
        from lora_conformance.report.document import build_report, write_report
        from lora_conformance.report.verify import verify

        report = build_report(self.environment(config), self.records.values())
        self.written = write_report(report, self.report_dir)
        self.verdict = verify(report["records"])

    def pytest_terminal_summary(self, terminalreporter):
        if self.verdict is None:
            return
        from lora_conformance.report.badge import badge_text

        from lora_conformance.report.root_causes import describe, headline

        tr = terminalreporter
        tr.write_sep("=", "LoRA conformance")
        tr.write_line(headline(self.verdict.root_causes))
        for i, cause in enumerate(self.verdict.root_causes, start=1):
            tr.write_line(f"  {i}. {describe(cause)}")
        columns = ("passed", "failed", "error", "xfail", "not certified", "skipped")
        header = ("suite",) + columns
        rows = [header] + [(suite,) + tuple(str(c[k]) for k in columns) for suite, c in self.verdict.suites.items()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            tr.write_line(" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                     for i, (cell, w) in enumerate(zip(row, widths))))
        device = (getattr(self.settings, "device", None) or "unknown").split(":", 1)[0]
        label, value = badge_text(self.verdict, device)
        tr.write_line(f"{label} · {value} ({'certified' if self.verdict.certified else 'not certified'})")
        tr.write_line(f"report: {self.written.get('report.html')}")


def feature_id(nodeid: str) -> str:
    """Convenience re-export: the feature id a test id is reported under."""
    return feature_of(nodeid)[1]
