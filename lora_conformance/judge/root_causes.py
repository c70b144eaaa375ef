"""Root causes: a run's failures grouped by the bug behind them, each headed by its diagnosis.

One engine bug usually fails several features; a reader (or a vendor fixing bugs) wants the
list of distinct causes first, each named by what the engine seems to do wrong. Cases that
failed, errored or xfailed are grouped:

1. by *diagnosis*, where the evidence names the hypothesis the engine's output is nearest
   (``{"hypothesis": {"nearest": ...}}``, an effect analysis whose nearest hypothesis is not the
   correct one, or a routing check's slot that is nearest another adapter's reference).
   Diagnoses of one family are one cause: "served as A" in one test, "served as B" or "base"
   (no adapter) in another are the same routing bug. The cause is headed ``closest to: served as A`` (the most
   frequent name first). "correct" is not a diagnosis: a failure whose nearest hypothesis is
   the correct one is grouped by its message;
2. otherwise by the exception type and its message with numbers, paths and ids made
   placeholders for *grouping only* ("rank 8" and "rank 16" are one cause); the cause is headed
   by a real message, with its names and numbers (a module name in an import error is never
   masked: another module is another cause);
3. comparison failures with no diagnosis of their own (a log-probability difference, say) in a
   suite where exactly one diagnosed cause failed join that cause, listed apart as
   "no diagnosis of their own": one injected bug is one root cause, and the reader sees which
   failures were attributed by place rather than by evidence.

Pure: a function of the verdict's cases, so a stored report re-verifies to the same causes.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

GROUPED_STATUSES = ("failed", "error", "xfail")
MAX_SIGNATURE = 200
CORRECT = "correct"
COMPARISON_TYPES = ("ConformanceAssertionError",)

_NORMALISERS = (
    (re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+\-~@]+){2,}[\\/]?"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b[0-9a-fA-F]{8,}(?:-[0-9a-fA-F]{4,})*\b"), "<id>"),
    (re.compile(r"(['\"])[^'\"\s]{1,64}\1"), r"\1<id>\1"),
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "<n>"),
)
_NAMES_MATTER = ("ModuleNotFoundError", "ImportError", "MissingDependency")
_URL = re.compile(r"(https?://[^\s)]+)")
_TYPED_MESSAGE = re.compile(r"^(?:error in \w+: )?([A-Za-z_]\w*(?:Error|Exception|Failure|Exit|Interrupt)): (.*)$",
                            re.S)
_SERVED_AS = re.compile(r"^served as (.+)$")


@dataclass
class RootCause:
    signature: str  # the grouping key
    features: list[str] = field(default_factory=list)  # feature ids, in case order
    cases: list[str] = field(default_factory=list)  # node ids
    statuses: dict[str, int] = field(default_factory=dict)  # case counts: failed / error / xfail
    example: str = ""  # one case's message, as it was (names and numbers kept)
    heading: str = ""  # what the reader sees first: the diagnosis, else a real message
    diagnoses: dict[str, int] = field(default_factory=dict)  # specific diagnosis -> cases
    messages: dict[str, str] = field(default_factory=dict)  # node id -> its first message line, as it was
    by_place: list[str] = field(default_factory=list)  # node ids attributed by suite, not by evidence

    @property
    def unexpected(self) -> bool:
        """True when some case failed or errored (not only recorded xfails)."""
        return bool(self.statuses.get("failed") or self.statuses.get("error"))

    @property
    def title(self) -> str:
        return self.heading or self.signature


def normalise(message: str, keep_names: bool = False) -> str:
    """The first non-empty line of ``message`` with paths, numbers and ids made placeholders (a
    grouping key; never shown in place of the message). ``keep_names``: quoted names stay."""
    line = next((ln.strip() for ln in str(message).splitlines() if ln.strip()), "")
    # URLs stay as they are: an upstream link names the bug.
    pieces = _URL.split(line)
    for i in range(0, len(pieces), 2):
        for pattern, placeholder in _NORMALISERS:
            if keep_names and placeholder == r"\1<id>\1":
                continue
            pieces[i] = pattern.sub(placeholder, pieces[i])
    line = " ".join("".join(pieces).split())
    return _bounded(line)


def _bounded(line: str) -> str:
    return line if len(line) <= MAX_SIGNATURE else line[: MAX_SIGNATURE - 1] + "…"


def _first_line(text: Any) -> str:
    return next((ln.strip() for ln in str(text or "").splitlines() if ln.strip()), "")


def diagnosis(evidence: Any) -> Optional[str]:
    """The hypothesis the evidence says the engine's output is nearest, when not the correct one."""
    if not isinstance(evidence, Mapping):
        return None
    hyp = evidence.get("hypothesis")
    if isinstance(hyp, Mapping) and isinstance(hyp.get("nearest"), str):
        nearest = hyp["nearest"].strip()
        if nearest and nearest != CORRECT:
            return nearest
    for analysis in evidence.get("analyses") or ():
        if isinstance(analysis, Mapping) and isinstance(analysis.get("nearest"), str):
            nearest = analysis["nearest"].strip()
            if nearest and nearest != CORRECT:
                return nearest
    if evidence.get("check") == "nearest_reference_routing":
        for row in evidence.get("rows") or ():
            if isinstance(row, Mapping) and row.get("ok") is False and row.get("nearest") != row.get("expected"):
                nearest = row.get("nearest")
                return "base" if nearest in (None, "__base__", "base") else f"served as {nearest}"
    return None


ROUTING_FAMILY = "a wrong adapter (another one, or none)"


def family(name: str) -> str:
    """Diagnoses that are one bug: a row served as another adapter ("served as X") or as none
    ("base") got the wrong adapter, a routing bug; a routing fault shows as both."""
    return ROUTING_FAMILY if _SERVED_AS.match(name) or name == "base" else name


def signature(case: Any) -> tuple[str, str, Optional[str]]:
    """(grouping key, the case's message as it was, its diagnosis or None) of one failed, errored
    or xfailed case (a ``verify.Case``)."""
    evidence = case.evidence if isinstance(case.evidence, Mapping) else None
    failure = case.failure if isinstance(case.failure, Mapping) else None
    message = _first_line((failure or {}).get("message") or case.reason)
    found = diagnosis(evidence)
    if found is not None:
        return f"closest to: {family(found)}", message, found
    kind = (failure or {}).get("type")
    if evidence is not None and evidence.get("check") and evidence.get("summary"):
        kind = kind or "ConformanceAssertionError"
        summary = _first_line(evidence["summary"])
        return f"{kind}: {evidence['check']}: {normalise(summary)}", f"{evidence['check']}: {summary}", None
    if kind:
        keep = kind in _NAMES_MATTER
        text = _first_line(failure.get("message"))
        return f"{kind}: {normalise(text, keep)}".rstrip(": "), f"{kind}: {text}".rstrip(": "), None
    typed = _TYPED_MESSAGE.match(case.reason or "")
    if typed and case.status != "xfail":
        keep = typed.group(1) in _NAMES_MATTER
        return f"{typed.group(1)}: {normalise(typed.group(2), keep)}", message, None
    if case.status == "xfail":
        return f"xfail: {normalise(case.reason)}", message, None
    return f"{case.status}: {normalise(case.reason)}", message, None


def _add(cause: RootCause, case: Any, message: str) -> None:
    if case.feature not in cause.features:
        cause.features.append(case.feature)
    cause.cases.append(case.nodeid)
    cause.statuses[case.status] = cause.statuses.get(case.status, 0) + 1
    cause.messages[case.nodeid] = message


def _is_comparison(case: Any) -> bool:
    failure = case.failure if isinstance(case.failure, Mapping) else {}
    evidence = case.evidence if isinstance(case.evidence, Mapping) else {}
    return failure.get("type") in COMPARISON_TYPES or bool(evidence.get("check"))


def root_causes(cases: Iterable[Any]) -> list[RootCause]:
    """Failed, errored and xfailed cases grouped by cause; unexpected ones first, then most features."""
    groups: dict[str, RootCause] = {}
    undiagnosed: list[tuple[Any, str, str]] = []
    diagnosed_by_suite: dict[str, set[str]] = {}
    for case in cases:
        if case.status not in GROUPED_STATUSES:
            continue
        sig, message, found = signature(case)
        if found is None:
            undiagnosed.append((case, sig, message))
            continue
        cause = groups.setdefault(sig, RootCause(sig, example=message))
        cause.diagnoses[found] = cause.diagnoses.get(found, 0) + 1
        diagnosed_by_suite.setdefault(case.suite, set()).add(sig)
        _add(cause, case, message)
    for case, sig, message in undiagnosed:
        owners = diagnosed_by_suite.get(case.suite, set())
        if len(owners) == 1 and _is_comparison(case):
            cause = groups[next(iter(owners))]
            cause.by_place.append(case.nodeid)
        else:
            cause = groups.setdefault(sig, RootCause(sig, example=message))
        _add(cause, case, message)
    for cause in groups.values():
        if cause.diagnoses:
            names = [n for n, _ in Counter(cause.diagnoses).most_common()]
            cause.heading = f"closest to: {names[0]}" + (f" (also {', '.join(names[1:])})" if names[1:] else "")
            if cause.signature == f"closest to: {ROUTING_FAMILY}":
                cause.heading += f": rows got {ROUTING_FAMILY}"
        else:
            variants = len(set(cause.messages.values()))
            cause.heading = _bounded(cause.example) + (f" (and {variants - 1} variant{'s' if variants > 2 else ''})"
                                                       if variants > 1 else "")
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
    """One line: the heading, then each feature (case counts by status)."""
    counts = ", ".join(f"{n} {s}" for s, n in cause.statuses.items())
    return f"{cause.title} [{counts}]: {', '.join(cause.features)}"


def from_dicts(items: Iterable[Mapping[str, Any]]) -> list[RootCause]:
    """RootCause objects back from a report's JSON (``verdict.root_causes``); tolerant of old ones."""
    out = []
    for i in items:
        if not isinstance(i, Mapping):
            continue
        out.append(RootCause(str(i.get("signature")), [str(f) for f in i.get("features") or []],
                             [str(c) for c in i.get("cases") or []],
                             {str(k): v for k, v in (i.get("statuses") or {}).items() if isinstance(v, int)},
                             str(i.get("example") or ""), str(i.get("heading") or ""),
                             {str(k): v for k, v in (i.get("diagnoses") or {}).items() if isinstance(v, int)},
                             {str(k): str(v) for k, v in (i.get("messages") or {}).items()},
                             [str(c) for c in i.get("by_place") or []]))
    return out
