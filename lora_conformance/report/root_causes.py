"""Root causes: a run's failures grouped by what caused them, with the features under each.

One engine bug usually fails several features; a reader (or a vendor fixing bugs) wants the
list of distinct causes first. Cases that failed, errored or xfailed are grouped by a
*signature*:

- an accuracy failure whose evidence names the nearest hypothesis
  (``{"hypothesis": {"nearest": "<name>"}}``, computed by the suites where they can) is
  grouped by that hypothesis: ``hypothesis: <name>``;
- any other failure by its exception type and its normalised message: the first line, with
  paths, numbers, hexadecimal and quoted ids replaced by placeholders (URLs kept), so "adapter 'r8' ...
  rank 8" and "adapter 'r16' ... rank 16" are one cause. A comparison failure
  (ConformanceAssertionError) uses its evidence's ``check`` and ``summary`` instead of the
  message, whose first line names the request;
- records written before failures were recorded structurally (no ``failure``) fall back to
  the failure message (``Type: text``) and, for an xfail, to its recorded reason.

Pure: a function of the verdict's cases, so a stored report re-verifies to the same causes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

GROUPED_STATUSES = ("failed", "error", "xfail")
MAX_SIGNATURE = 200

_NORMALISERS = (
    (re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+\-~@]+){2,}[\\/]?"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b[0-9a-fA-F]{8,}(?:-[0-9a-fA-F]{4,})*\b"), "<id>"),
    (re.compile(r"(['\"])[^'\"\s]{1,64}\1"), r"\1<id>\1"),
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "<n>"),
)
_URL = re.compile(r"(https?://[^\s)]+)")
_TYPED_MESSAGE = re.compile(r"^(?:error in \w+: )?([A-Za-z_]\w*(?:Error|Exception|Failure|Exit|Interrupt)): (.*)$",
                            re.S)


@dataclass
class RootCause:
    signature: str
    features: list[str] = field(default_factory=list)  # feature ids, in case order
    cases: list[str] = field(default_factory=list)  # node ids
    statuses: dict[str, int] = field(default_factory=dict)  # case counts: failed / error / xfail
    example: str = ""  # one case's message, not normalised

    @property
    def unexpected(self) -> bool:
        """True when some case failed or errored (not only recorded xfails)."""
        return bool(self.statuses.get("failed") or self.statuses.get("error"))


def normalise(message: str) -> str:
    """The first non-empty line of ``message`` with paths, numbers and ids made placeholders."""
    line = next((ln.strip() for ln in str(message).splitlines() if ln.strip()), "")
    # URLs stay as they are: an upstream link names the bug.
    pieces = _URL.split(line)
    for i in range(0, len(pieces), 2):
        for pattern, placeholder in _NORMALISERS:
            pieces[i] = pattern.sub(placeholder, pieces[i])
    line = " ".join("".join(pieces).split())
    return line if len(line) <= MAX_SIGNATURE else line[: MAX_SIGNATURE - 1] + "…"


def _hypothesis(evidence: Any) -> Optional[str]:
    if isinstance(evidence, Mapping) and isinstance(evidence.get("hypothesis"), Mapping):
        nearest = evidence["hypothesis"].get("nearest")
        if isinstance(nearest, str) and nearest.strip():
            return nearest.strip()
    return None


def signature(case: Any) -> tuple[str, str]:
    """(signature, example message) of one failed, errored or xfailed case (a ``verify.Case``)."""
    evidence = case.evidence if isinstance(case.evidence, Mapping) else None
    nearest = _hypothesis(evidence)
    failure = case.failure if isinstance(case.failure, Mapping) else None
    example = str((failure or {}).get("message") or case.reason or "").strip().splitlines()
    example_line = example[0] if example else ""
    if nearest is not None:
        return f"hypothesis: {nearest}", example_line
    if evidence is not None and evidence.get("check") and evidence.get("summary"):
        kind = (failure or {}).get("type") or "ConformanceAssertionError"
        return f"{kind}: {evidence['check']}: {normalise(evidence['summary'])}", example_line
    if failure is not None and failure.get("type"):
        return f"{failure['type']}: {normalise(failure.get('message') or '')}".rstrip(": "), example_line
    # Older records: the message carries "Type: text"; an xfail without one, its recorded reason.
    typed = _TYPED_MESSAGE.match(case.reason or "")
    if typed and case.status != "xfail":
        return f"{typed.group(1)}: {normalise(typed.group(2))}", example_line
    if case.status == "xfail":
        return f"xfail: {normalise(case.reason)}", example_line
    return f"{case.status}: {normalise(case.reason)}", example_line


def root_causes(cases: Iterable[Any]) -> list[RootCause]:
    """Failed, errored and xfailed cases grouped by signature; most features first."""
    groups: dict[str, RootCause] = {}
    for case in cases:
        if case.status not in GROUPED_STATUSES:
            continue
        sig, example = signature(case)
        cause = groups.setdefault(sig, RootCause(sig, example=example))
        if case.feature not in cause.features:
            cause.features.append(case.feature)
        cause.cases.append(case.nodeid)
        cause.statuses[case.status] = cause.statuses.get(case.status, 0) + 1
    return sorted(groups.values(), key=lambda c: (not c.unexpected, -len(c.features), -len(c.cases), c.signature))


def headline(causes: list[RootCause]) -> str:
    """``N root causes (K with unexpected failures, M recorded as xfail only)``, or ``no failures``."""
    if not causes:
        return "no failures: 0 root causes"
    unexpected = sum(1 for c in causes if c.unexpected)
    word = "root cause" if len(causes) == 1 else "root causes"
    return (f"{len(causes)} {word} ({unexpected} with unexpected failures, "
            f"{len(causes) - unexpected} recorded as xfail only)")


def describe(cause: RootCause) -> str:
    """One line: the signature, then each feature (case counts by status)."""
    counts = ", ".join(f"{n} {s}" for s, n in cause.statuses.items())
    return f"{cause.signature} [{counts}]: {', '.join(cause.features)}"


def from_dicts(items: Iterable[Mapping[str, Any]]) -> list[RootCause]:
    """RootCause objects back from a report's JSON (``verdict.root_causes``)."""
    return [RootCause(str(i.get("signature")), list(i.get("features") or []), list(i.get("cases") or []),
                      dict(i.get("statuses") or {}), str(i.get("example") or "")) for i in items]
