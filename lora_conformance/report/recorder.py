"""Execution side of the report: record every test's outcome and the run's selection, write the report.

Register ``ReportRecorder(settings, report_dir)`` as a plugin on the controller. What it reads
from each ``TestReport`` is what pytest-xdist carries from workers to the controller:

- ``nodeid``, ``when``, ``outcome``, ``duration``, ``wasxfail`` (xfail reason),
- the skip reason (``longrepr`` = ``(path, line, "Skipped: reason")``),
- for failures, ``longrepr.reprcrash.message`` and ``longreprtext``,
- the structured facts in ``user_properties`` (``lora_conformance.evidence``: feature, outcome,
  failure, evidence, effects, notes), written by the plugin's ``pytest_runtest_makereport``
  (``evidence.attach_call_facts``, the one writer) and by the harness.

It folds them into one ``evidence.Record`` per node id. The selection (``report.selection``)
comes from the controller's options and the cases pytest deselected: in this process
(``pytest_deselected``), or on pytest-xdist workers, which ship theirs (``ship_deselected``)
in ``workeroutput``. Verification is ``verify.verify``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import pytest

from lora_conformance import evidence
from lora_conformance.evidence import Record

# The plugin may put environment facts that need torch or the engine here (deep-merged over
# what the recorder computes): {"engine": {"version": ..., "capabilities": [...]},
# "device": {"device_name": ..., "driver": ...}, ...}.
ENV_KEY = pytest.StashKey[dict]()
DESELECTED_OUTPUT = "lora_deselected"  # workeroutput key: JSON {nodeid: feature id}
ENVIRONMENT_OUTPUT = "lora_environment"  # workeroutput key: JSON of a worker's environment facts
AUDIT_OUTPUT = "lora_audit"  # workeroutput key: JSON of a worker's audit (judge.audit)
# A test's user property at its teardown: its process's reference work so far (Workspace.reference_work,
# JSON); the report sums each process's latest, so a run stopped early still says what it computed.
REFERENCE_WORK_PROPERTY = "lora_reference_work"
# And its process's device memory peaks while that test ran (devices.memory_peaks, reset after each
# test; JSON), where it used an accelerator: the report keeps each test's and folds each process's.
DEVICE_MEMORY_PROPERTY = "lora_device_memory"
AUDITS_KEY = pytest.StashKey[list]()  # every process's audit, gathered on the controller
MAX_TEXT = 8000


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _feature_ids(items: list) -> dict[str, str]:
    """Each item's node id -> the feature id it is reported under."""
    from lora_conformance.features import item_feature_id

    return {item.nodeid: item_feature_id(item) for item in items}


def run_environment(config: pytest.Config) -> dict:
    """What this run learns about its environment (engine version, device name, ...), for the report;
    the harness fills it, pytest-xdist workers ship theirs to the controller (``ship_environment``)."""
    return config.stash.setdefault(ENV_KEY, {})


def ship_environment(config: pytest.Config, environment: dict) -> None:
    """On a pytest-xdist worker, at its end: what only its live engines knew, for the controller."""
    config.workeroutput[ENVIRONMENT_OUTPUT] = json.dumps(environment, default=str)


def receive_environment(node: Any) -> None:
    """On the controller, as a worker goes down: its environment facts, where ours have none yet."""
    raw = getattr(node, "workeroutput", {}).get(ENVIRONMENT_OUTPUT)
    if raw:
        environment = run_environment(node.config)
        for key, value in json.loads(raw).items():
            environment.setdefault(key, value)


def fold_device_peaks(so_far: dict, peaks: dict) -> dict:
    """A process's device memory peaks over its tests, from each test's own: each figure's largest."""
    return {key: max(int(so_far.get(key) or 0), int(value)) for key, value in peaks.items()}


def device_memory_summary(per_process: dict[str, dict], records: Iterable[Record] = ()) -> dict[str, Any]:
    """Each process's device memory peaks (``devices.memory_peaks``): the largest of one process,
    which is what a worker needs, and the sum of the reserved peaks, an upper bound of the run's use
    at once (the peaks need not coincide); and the case that held the most (records' ``device_peak``),
    which is what decides whether another worker fits."""
    def peaks(key: str) -> list[int]:
        return [int(p.get(key) or 0) for p in per_process.values()]

    out: dict[str, Any] = {"processes": len(per_process),
                           "largest_peak_allocated": max(peaks("peak_allocated"), default=0),
                           "largest_peak_reserved": max(peaks("peak_reserved"), default=0),
                           "summed_peak_reserved": sum(peaks("peak_reserved"))}
    cases = [r for r in records if r.device_peak is not None]
    if cases:
        top = max(cases, key=lambda r: r.device_peak)
        out.update(largest_case=top.nodeid, largest_case_peak_allocated=top.device_peak)
    return out


def sum_reference_work(per_process: dict[str, dict]) -> dict[str, float]:
    """Each process's reference work (``Workspace.reference_work``) summed, with how many processes."""
    from lora_conformance.reference import sum_work

    return {"processes": len(per_process), **sum_work(per_process.values())}


def keep_audit(config: pytest.Config, audit: dict) -> None:
    """This process's audit: on a pytest-xdist worker shipped to the controller, else kept for the report."""
    if hasattr(config, "workeroutput"):
        config.workeroutput[AUDIT_OUTPUT] = json.dumps(audit, default=str)
    else:
        config.stash.setdefault(AUDITS_KEY, []).append(audit)


def receive_audit(node: Any) -> None:
    """On the controller, as a worker goes down: its audit."""
    raw = getattr(node, "workeroutput", {}).get(AUDIT_OUTPUT)
    if raw:
        node.config.stash.setdefault(AUDITS_KEY, []).append(json.loads(raw))


def gathered_audit(config: pytest.Config) -> dict:
    """Every process's audit as one: cases sampled, their ids and seeds, and every mismatch."""
    audits = config.stash.get(AUDITS_KEY, [])
    return {"sampled": sum(int(a.get("sampled") or 0) for a in audits),
            "seeds": [a.get("seed") for a in audits], "cases": [c for a in audits for c in a.get("cases") or ()],
            "mismatches": [m for a in audits for m in a.get("mismatches") or ()]}


def ship_deselected(config: pytest.Config, items: list) -> None:
    """On a pytest-xdist worker: add ``items`` to the deselected cases the controller will read."""
    shipped = json.loads(config.workeroutput.get(DESELECTED_OUTPUT) or "{}")
    shipped.update(_feature_ids(items))
    config.workeroutput[DESELECTED_OUTPUT] = json.dumps(shipped)


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


def _phase(when: Any, recorded: Mapping[str, str]) -> str:
    """The phase a report is about. pytest-xdist reports a test whose worker crashed (a segfault in
    the engine, say) with the phase ``???``: that is the phase after the last one the test reported
    (setup, then call, then teardown), which failed."""
    if when in evidence.PHASES:
        return when
    return next((p for p in evidence.PHASES[1:] if p not in recorded), "teardown")  # after collect


class ReportRecorder:
    def __init__(self, settings: Any, report_dir: "str | Path"):
        self.settings = settings
        self.report_dir = Path(report_dir)
        self.records: dict[str, Record] = {}
        self.deselected: dict[str, str] = {}  # node id -> feature id
        self.written: dict[str, Path] = {}
        self.verdict = None
        self.reference_work: dict[str, dict] = {}  # process (xdist worker id, or "main") -> its latest
        self.device_memory: dict[str, dict] = {}  # likewise: its device memory peaks so far
        self.crashed_workers = 0  # pytest-xdist workers that died (a segfault in the engine, say)
        # Every case the run selected (node id -> its feature id where known): those without a
        # record at the end were never reached (an interrupt, xdist's stop after crashed workers).
        self.collected: dict[str, Optional[str]] = {}
        self.report: Optional[dict] = None
        self.config: Optional[pytest.Config] = None
        self.started_at: Optional[float] = None  # time.time() at the session's start

    # ---- execution: what happened ---------------------------------------------------

    def _record(self, nodeid: str) -> Record:
        return self.records.setdefault(nodeid, Record(nodeid))

    def pytest_runtest_logreport(self, report):
        if self.config is not None and _is_worker(self.config):
            return
        rec = self._record(report.nodeid)
        phase = _phase(report.when, rec.phases)
        rec.phases[phase] = report.outcome
        process = str(getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None) or "main")
        rec.worker = process
        if report.when == "setup" and self.started_at is not None and isinstance(getattr(report, "start", None), float):
            rec.started = round(report.start - self.started_at, 3)  # the workers' clock is this machine's
        if report.when == "teardown":
            work = evidence.values(report, REFERENCE_WORK_PROPERTY)
            if work:
                self.reference_work[process] = json.loads(work[-1])
            memory = evidence.values(report, DEVICE_MEMORY_PROPERTY)
            if memory:
                peaks = json.loads(memory[-1])
                self.device_memory[process] = fold_device_peaks(self.device_memory.get(process, {}), peaks)
                rec.device_peak = int(peaks["peak_allocated"])
        rec.duration = round(rec.duration + float(report.duration or 0.0), 6)
        if getattr(report, "wasxfail", None) is not None:
            rec.wasxfail = str(report.wasxfail)
        rec.feature = rec.feature or evidence.first_object(report, evidence.FEATURE)
        starts = evidence.all_list_items(report, evidence.ENGINE_STARTS)
        if starts:  # each phase's report carries the item's properties so far: keep each start once
            rec.engine_starts = (rec.engine_starts or []) + [s for s in starts if s not in (rec.engine_starts or [])]
        if report.when == "call":
            rec.effects = rec.effects or evidence.all_list_items(report, evidence.EFFECTS)
            rec.notes = rec.notes or ([str(n) for n in evidence.values(report, evidence.NOTE)] or None)
        if report.skipped and rec.skip_reason is None:
            rec.skip_reason = _skip_reason(report)
            rec.outcome = evidence.first_object(report, evidence.OUTCOME)
        if report.failed or getattr(report, "wasxfail", None) is not None:
            rec.failure = rec.failure or evidence.first_object(report, evidence.FAILURE)
            # An xfail's evidence too: its nearest hypothesis groups it with the failures of its bug.
            rec.evidence = rec.evidence or evidence.first_object(report, evidence.EVIDENCE)
        if report.failed and rec.message is None:  # the first failure is the cause; a teardown error follows
            rec.message = _failure_message(report)
            if phase != report.when:  # a crashed worker: one message for every crash, so they group
                worker = re.search(r"worker '([^']+)' crashed", rec.message)
                rec.message = (f"the test's worker process died during {phase} (pytest-xdist worker "
                               f"'{worker.group(1) if worker else '?'}' crashed: a segfault or abort in native "
                               f"code, or the system's out-of-memory killer)")
            rec.longrepr = (getattr(report, "longreprtext", "") or "")[-MAX_TEXT:] or None

    def pytest_collectreport(self, report):
        if report.failed and (self.config is None or not _is_worker(self.config)):
            rec = self._record(report.nodeid or "(session)")
            rec.phases["collect"] = "failed"
            rec.message = _failure_message(report)
            rec.longrepr = (getattr(report, "longreprtext", "") or "")[-MAX_TEXT:] or None

    # ---- selection: what the run left out --------------------------------------------------

    def pytest_deselected(self, items):
        self.deselected.update(_feature_ids(items))

    def pytest_collection_finish(self, session):
        # Without pytest-xdist this process collects (with it, the workers do: the hook below).
        if self.config is None or not _is_worker(self.config):
            self.collected.update(_feature_ids(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        for nodeid in ids:
            self.collected.setdefault(nodeid, None)

    def not_reached(self) -> dict[str, str]:
        """The selected cases that never ran, with their feature ids: the collection's where this
        process collected, else a recorded case's of the same test function, else the node id's."""
        by_function = {nodeid.split("[", 1)[0]: rec.feature["id"] for nodeid, rec in self.records.items()
                       if isinstance(rec.feature, dict) and isinstance(rec.feature.get("id"), str)}
        from lora_conformance.features import feature_of

        return {nodeid: feature or by_function.get(nodeid.split("[", 1)[0]) or feature_of(nodeid)[1]
                for nodeid, feature in sorted(self.collected.items())
                if nodeid not in self.records and nodeid not in self.deselected}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        if error is not None:
            self.crashed_workers += 1
        shipped = getattr(node, "workeroutput", {}).get(DESELECTED_OUTPUT)
        if shipped:
            self.deselected.update(json.loads(shipped))

    # ---- session ---------------------------------------------------------------------

    def pytest_sessionstart(self, session):
        import time

        self.config = session.config
        self.started_at = time.time()
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
        from lora_conformance.report.selection import describe
        from lora_conformance.judge.verdict import verify

        if self.reference_work:  # what the run's references computed, summed over its processes
            run_environment(config).setdefault("reference", {})["work"] = sum_reference_work(self.reference_work)
        if self.device_memory:  # what its processes held on the device, at most
            run_environment(config)["device_memory"] = device_memory_summary(self.device_memory, self.records.values())
        selection = describe(config, self.deselected, self.records, exitstatus, self.crashed_workers,
                             self.not_reached())
        certification = self.certification(config, selection)
        self.report = build_report(self.environment(config), self.records.values(), selection, certification)
        self.written = write_report(self.report, self.report_dir)
        self.verdict = verify(self.report["records"], selection, certification)
        if certification["audit"]["mismatches"] and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the audit failed the run

    def certification(self, config: pytest.Config, selection: dict) -> dict[str, Any]:
        """The run's mode, the waivers its expectations applied (each with whether a stale one was
        re-confirmed) and its audit (``lora_conformance.certification``, ``judge.audit``)."""
        from lora_conformance import certification as cert

        mode = cert.CERTIFIED if getattr(self.settings, "certified", False) else cert.OPEN
        expectations = config.pluginmanager.get_plugin("lora-conformance-expectations")
        waived = cert.waivers(self.records.values(), expectations.lookup, mode) if expectations else []
        return {"mode": mode, "suite_version": cert.suite_version(),
                "suite_sha256": ((selection or {}).get("suite") or {}).get("sha256"),
                "expectations": str(expectations.path) if expectations else None,
                "waived": waived, "audit": gathered_audit(config)}

    def pytest_terminal_summary(self, terminalreporter):
        if self.verdict is None:
            return
        from lora_conformance.judge.root_causes import describe, headline

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
        from lora_conformance.report.document import status_line
        from lora_conformance.report.selection import narrowing

        narrowed = narrowing(self.report.get("selection") if self.report else None)
        if self.verdict.partial:
            cov = self.verdict.summary["coverage"]
            tr.write_line(f"partial run: {cov['features_run']} of {cov['features_declared']} features ran"
                          + (f" (selected by {', '.join(narrowed)})" if narrowed else "")
                          + "; a certification runs them all")
        tr.write_line(status_line(self.report or {}, self.verdict))
        work = ((self.report or {}).get("environment") or {}).get("reference", {}).get("work")
        if work:
            from lora_conformance.report.markdown import reference_work_summary

            tr.write_line(f"reference: {reference_work_summary(work)}")
        memory = ((self.report or {}).get("environment") or {}).get("device_memory")
        if memory:
            from lora_conformance.report.markdown import device_memory_text

            tr.write_line(f"device memory: {device_memory_text(memory)}")
        tr.write_line(f"report: {self.written.get('report.html')}")
