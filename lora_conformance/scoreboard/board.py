"""The scoreboard's model: stored reports as entries, each feature of each as a cell, products as
columns, and the aligned view. Pure functions of the reports (no HTML here).

A **product** is an engine (with its variant: the engine arguments that select one, long values
named only and timeouts left out), a device type and a dtype. A **column** is one product at one
suite version: its most complete run (a full run before one of unknown coverage before a partial
one), the newest among equals; the other runs of it are listed as superseded, never dropped.

A **cell** is one feature of one column: ``passed``, ``failed``, ``error``, ``waived`` (a certified
run's xfail or skip that a waiver with a filed issue covers), ``xfail`` (an open run's expected
failure), ``not certified`` (the engine does not declare what the feature needs), ``skipped`` (not
applicable), or no cell at all (the run did not have the feature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from lora_conformance.judge.verdict import Verdict
from lora_conformance.scoreboard.integrity import Integrity, stored_digest

CELL_STATUSES = ("passed", "waived", "xfail", "failed", "error", "not certified", "skipped")
FAILING = ("failed", "error", "xfail")  # the statuses whose cases the report lists under a root cause
MAX_ARG = 40


def suite_version_of(report: Mapping[str, Any]) -> str:
    """The suite version a report ran: its certification's, else its selection's (the suite files
    it ran), else the environment's; ``unknown`` for a report that recorded none."""
    for holder, key in ((report.get("certification"), "suite_version"),
                        (((report.get("selection") or {}).get("suite")), "version"),
                        (report.get("environment"), "suite_version")):
        if isinstance(holder, Mapping) and isinstance(holder.get(key), str) and holder[key]:
            return holder[key]
    return "unknown"


def mode_of(report: Mapping[str, Any]) -> str:
    """``certified`` or ``open`` (every report from before certified mode was an open run)."""
    cert = report.get("certification")
    return "certified" if isinstance(cert, Mapping) and cert.get("mode") == "certified" else "open"


def variant_of(args: Mapping[str, Any]) -> str:
    """The engine arguments that select a variant: ``mode=served``; long values by name only
    (``server_cmd=…``), timeouts left out (they do not change what is certified)."""
    parts = []
    for key in sorted(args or {}):
        if "timeout" in key:
            continue
        value = str(args[key])
        parts.append(f"{key}={value}" if len(value) <= MAX_ARG else f"{key}=…")
    return ", ".join(parts)


@dataclass
class Cell:
    status: str
    reason: str = ""
    anchor: str = ""  # the id in the report page this cell links to
    diagnosis: str = ""  # the root cause the linked case is under
    waivers: list = field(default_factory=list)  # the certification's waiver entries of this feature


@dataclass
class Entry:
    """One stored report, read and checked."""

    path: Path
    rel: str  # its path under the reports directory
    slug: str  # its page's name in the site
    raw: dict
    report: dict
    verdict: Verdict
    stored_verdict_same: bool
    integrity: Integrity
    revoked: Optional[str] = None  # the reason, when revoked.toml names its digest
    cells: dict = field(default_factory=dict)  # feature id -> Cell
    superseded_by: Optional[str] = None  # the slug of the column's chosen run

    @property
    def env(self) -> Mapping[str, Any]:
        return self.report.get("environment") or {}

    @property
    def engine(self) -> str:
        return str((self.env.get("engine") or {}).get("name") or "unknown")

    @property
    def engine_version(self) -> str:
        return str((self.env.get("engine") or {}).get("version") or "")

    @property
    def variant(self) -> str:
        return variant_of((self.env.get("engine") or {}).get("args") or {})

    @property
    def device(self) -> str:
        return str((self.env.get("device") or {}).get("type") or "unknown")

    @property
    def dtype(self) -> str:
        return str(self.env.get("dtype") or "unknown")

    @property
    def suite_version(self) -> str:
        return suite_version_of(self.report)

    @property
    def mode(self) -> str:
        return mode_of(self.report)

    @property
    def date(self) -> str:
        return str(self.env.get("date") or "")

    @property
    def digest(self) -> Optional[str]:
        return stored_digest(self.raw)

    @property
    def product(self) -> tuple[str, str, str, str]:
        return self.engine, self.variant, self.device, self.dtype

    @property
    def product_label(self) -> str:
        return self.engine + (f" ({self.variant})" if self.variant else "") + f" · {self.device} · {self.dtype}"

    def completeness(self) -> int:
        """2: ran every declared feature, 1: coverage not recorded (schema 1), 0: partial."""
        coverage = self.verdict.summary.get("coverage")
        return 1 if coverage is None else (2 if coverage.get("complete") else 0)

    @property
    def counts(self) -> dict[str, int]:
        return counts(self.cells.values())

    def count_text(self) -> str:
        return count_text(self.counts, self.mode)


def waivers_by_feature(report: Mapping[str, Any]) -> dict[str, list[dict]]:
    cert = report.get("certification")
    out: dict[str, list[dict]] = {}
    for w in (cert.get("waived") or ()) if isinstance(cert, Mapping) else ():
        if isinstance(w, Mapping) and isinstance(w.get("feature"), str):
            out.setdefault(w["feature"], []).append(dict(w))
    return out


def feature_cells(report: Mapping[str, Any], verdict: Verdict) -> dict[str, Cell]:
    """Each feature's cell: its status (``waived`` where a certified run's waiver covers an xfail or a
    skip), reason, the case it links to (a failing one, inside its root cause, where there is one)."""
    from lora_conformance.report.html import case_anchor, feature_anchor

    waived = waivers_by_feature(report) if mode_of(report) == "certified" else {}
    cause_of = {n: cause.title for cause in verdict.root_causes for n in cause.cases}
    cases = {c.nodeid: c for c in verdict.cases}
    cells = {}
    for fid, feat in verdict.features.items():
        status = feat.status
        if fid in waived and status in ("xfail", "skipped"):
            status = "waived"
        failing = next((cases[n] for n in feat.cases if n in cases and cases[n].status in FAILING
                        and n in cause_of), None)
        cells[fid] = Cell(status, feat.reason,
                          case_anchor(failing.nodeid) if failing else feature_anchor(fid),
                          cause_of.get(failing.nodeid, "") if failing else "", waived.get(fid, []))
    return cells


def counts(cells: Iterable[Cell]) -> dict[str, int]:
    """Features per cell status, and ``counted``: every feature but the plainly skipped (not applicable) ones."""
    out = {s: 0 for s in CELL_STATUSES}
    for cell in cells:
        out[cell.status] += 1
    out["counted"] = sum(out[s] for s in CELL_STATUSES if s != "skipped")
    return out


def count_text(c: Mapping[str, int], mode: str) -> str:
    """``41 passed, 12 waived / 62`` (a certified run), ``33 passed, 20 xfail / 64`` (an open one)."""
    second = ("waived", c["waived"]) if mode == "certified" else ("xfail", c["xfail"] + c["waived"])
    return f"{c['passed']} passed, {second[1]} {second[0]} / {c['counted']}"


def choose_columns(entries: list[Entry]) -> list[Entry]:
    """One entry per (product, suite version), ordered by engine, variant, device, dtype and suite
    version; each other entry's ``superseded_by`` names the chosen one."""
    groups: dict[tuple, list[Entry]] = {}
    for e in entries:
        groups.setdefault(e.product + (e.suite_version,), []).append(e)
    columns = []
    for key in sorted(groups):
        ranked = sorted(groups[key], key=lambda e: (e.completeness(), e.date, e.rel), reverse=True)
        for other in ranked[1:]:
            other.superseded_by = ranked[0].slug
        columns.append(ranked[0])
    return columns


def aligned_versions(columns: Iterable[Entry]) -> set[str]:
    """The suite versions that every product among ``columns`` ran (wpt.fyi's aligned runs)."""
    columns = list(columns)
    products = {c.product for c in columns}
    ran: dict[str, set] = {}
    for c in columns:
        ran.setdefault(c.suite_version, set()).add(c.product)
    return {v for v, ps in ran.items() if ps == products}


def feature_rows(columns: Iterable[Entry]) -> list[str]:
    """Every feature any column has, sorted (so suites group)."""
    return sorted({fid for c in columns for fid in c.cells})
