"""Expectation files: known engine failures as data, matched by feature id.

A vendor keeps one TOML file per engine (and device type), in the style of array-api-tests'
skips/xfails files and ONNX backend-test filters::

    # ---- prompt logprobs with LoRA in multi-request batches (vLLM CPU) ----
    [[expect]]
    feature = "accuracy/prefill_logprobs_with_adapter"   # a suite test's feature id (its marker)
    # case = "bfloat16"       # optional: only these parametrisations (see below)
    status = "xfail"          # "xfail" (strict: an unexpected pass fails) or "skip" (not run)
    # strict = false          # optional, xfail only: the failure depends on engine state
    reason = "LogitsProcessorWithLoRA indexes prompt rows per request"
    link = "https://github.com/vllm-project/vllm/issues/NNNN"   # or ""

Matching: ``feature`` names the feature a test certifies (``@pytest.mark.feature(id, ...)``;
a test without the marker has the id its report row has, ``suite/function``), so renaming
a test function renames nothing. ``case`` narrows it to the parametrisations whose id
(``cpu-bfloat16-A``, what pytest shows in brackets) is ``case`` or holds it as a run of
whole ``-``-separated parts: ``case = "bfloat16"`` matches ``cpu-bfloat16`` and
``cpu-bfloat16-A``, never ``cpu-bfloat16x``. An entry with a case beats one without.

Entries matching nothing are reported (a pytest warning and a terminal-summary line) when
their suite was part of the run, so stale entries surface without noise from partial runs.

Which file: ``--expectations FILE`` (or LORA_CONFORMANCE_EXPECTATIONS / the ini key);
otherwise the packaged ``expectations/<engine>-<device type>.toml`` if present, else
``expectations/<engine>.toml`` -- the more specific file wins, the two are not merged.
"""

from __future__ import annotations

import re
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

STATUSES = ("xfail", "skip")
FIELDS = ("feature", "case", "status", "reason", "link", "strict", "recorded_against")
PACKAGED_DIR = Path(__file__).parent / "expectations"


class UnmatchedExpectationWarning(pytest.PytestWarning):
    """An expectation entry matched no collected test (stale or misspelled feature id)."""


@dataclass(frozen=True)
class Expectation:
    feature: str  # a feature id (suite/name)
    status: str
    reason: str
    link: str
    index: int  # 1-based position in the file, for messages
    # xfail only: False for a failure that depends on engine state (an unexpected pass is reported,
    # not failed). Default True.
    strict: bool = True
    case: str = ""  # optional: a parametrisation id or a run of its '-'-separated parts
    recorded_against: str = ""  # the suite version the entry was recorded against (certified runs need it)

    @property
    def key(self) -> tuple[str, str]:
        return (self.feature, self.case)

    @property
    def label(self) -> str:
        return self.feature + (f" [case {self.case}]" if self.case else "")

    def matches(self, feature: str, case: str = "") -> bool:
        """Does this entry apply to a test with this feature id and parametrisation id?"""
        return feature == self.feature and (not self.case or case_matches(self.case, case))

    def rank(self) -> tuple[int, int]:
        """Specificity: feature + case > feature; then the longer case."""
        return (1 if self.case else 0, len(self.case))

    def describe(self) -> str:
        return f"expected: {self.reason}" + (f" ({self.link})" if self.link else "")


def case_matches(wanted: str, param_id: str) -> bool:
    """``wanted`` is the parametrisation id or a run of its whole '-'-separated parts."""
    if not param_id:
        return False
    if wanted == param_id:
        return True
    parts, want = param_id.split("-"), wanted.split("-")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def item_feature_and_case(item: Any) -> tuple[str, str]:
    """(feature id, parametrisation id) of a collected item (``features.item_feature_id``)."""
    from lora_conformance.features import item_feature_id

    callspec = getattr(item, "callspec", None)
    return item_feature_id(item), (callspec.id if callspec is not None else "")


def _bad(path: Path, where: str, problem: str) -> pytest.UsageError:
    return pytest.UsageError(f"expectations file {path}: {where}: {problem}")


def load_expectations(path: Path) -> list[Expectation]:
    """Parse and validate a file; every problem is a UsageError naming file, entry and field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise pytest.UsageError(f"expectations file {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise pytest.UsageError(f"expectations file {path}: cannot be read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise pytest.UsageError(f"expectations file {path}: not valid TOML ({exc})") from None
    extra = sorted(set(data) - {"expect"})
    if extra:
        raise _bad(path, "top level", f"unknown key(s) {', '.join(extra)}; expected only [[expect]] tables")
    entries = data.get("expect", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise _bad(path, "top level", "'expect' must be an array of tables, written [[expect]]")
    out: list[Expectation] = []
    seen: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(entries, start=1):
        e = _entry(path, i, raw)
        if e.key in seen:
            field = "feature' and 'case" if e.case else "feature"
            raise _bad(path, f"entry {i}", f"field '{field}': {e.label!r} repeats entry {seen[e.key]}")
        seen[e.key] = i
        out.append(e)
    return out


def _entry(path: Path, i: int, raw: dict[str, Any]) -> Expectation:
    from lora_conformance.features import FEATURE_ID

    where = f"entry {i}"
    if "id" in raw:
        raise _bad(path, where, "field 'id' (a node-id prefix) is no longer accepted; write "
                                'feature = "suite/name" (and case = "..." for some parametrisations only) '
                                "as the report's rows show")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise _bad(path, where, f"unknown field(s) {', '.join(unknown)}; expected fields: {', '.join(FIELDS)}")
    for field in ("feature", "status", "reason"):
        value = raw.get(field)
        if not isinstance(value, str) or not value.strip():
            raise _bad(path, where, f"field {field!r} is {'missing' if value is None else repr(value)}; "
                                    f"expected a non-empty string")
    feature = raw["feature"].strip()
    if not FEATURE_ID.match(feature):
        raise _bad(path, where, f"field 'feature' is {feature!r}; expected a feature id of the form suite/name "
                                "(lower case letters, digits, '_', '.', '-'), as in the report's rows")
    case = raw.get("case", "")
    if not isinstance(case, str) or ("case" in raw and not case.strip()):
        raise _bad(path, where, f"field 'case' is {case!r}; expected a parametrisation id such as 'cpu-bfloat16' "
                                "or a part of it such as 'bfloat16'")
    if raw["status"] not in STATUSES:
        raise _bad(path, where, f"field 'status' is {raw['status']!r}; expected one of {', '.join(STATUSES)}")
    link = raw.get("link", "")
    if not isinstance(link, str) or (link and not re.match(r"https?://\S+$", link)):
        raise _bad(path, where, f"field 'link' is {link!r}; expected an http(s) URL or an empty string")
    strict = raw.get("strict", True)
    if not isinstance(strict, bool) or (not strict and raw["status"] != "xfail"):
        raise _bad(path, where, f"field 'strict' is {strict!r}; expected true or false (false only with status xfail)")
    recorded = raw.get("recorded_against", "")
    if not isinstance(recorded, str) or ("recorded_against" in raw and not re.fullmatch(r"[0-9][0-9A-Za-z.+-]*",
                                                                                          recorded.strip())):
        raise _bad(path, where, f"field 'recorded_against' is {recorded!r}; expected the suite version the entry was "
                                "recorded against, such as '0.1.0' (lora-conformance --version)")
    return Expectation(feature=feature, status=raw["status"], reason=raw["reason"].strip(), link=link, index=i,
                       strict=strict, case=case.strip(), recorded_against=recorded.strip())


def default_expectations_path(engine: str, device_type: str) -> Optional[Path]:
    """The packaged file for this engine: ``<engine>-<device type>.toml``, else ``<engine>.toml``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", engine or ""):
        return None  # module:Class engines have no packaged file
    for name in (f"{engine}-{device_type}.toml", f"{engine}.toml"):
        candidate = PACKAGED_DIR / name
        if candidate.is_file():
            return candidate
    return None


class ExpectationsPlugin:
    """Registered by the lora-conformance plugin; marks collected items from one file."""

    def __init__(self, path: Path, certified: bool = False):
        self.path = Path(path)
        self.entries = load_expectations(self.path)
        self.certified = certified
        if certified:
            from lora_conformance.certification import entry_refusal

            for e in self.entries:
                problem = entry_refusal(e)
                if problem:
                    raise _bad(self.path, f"entry {e.index} ({e.label})", f"{problem} (--lora-certified)")
        self.applied: dict[str, int] = {"xfail": 0, "skip": 0}
        self.unmatched: list[Expectation] = []
        self.collected = False

    def lookup(self, nodeid: str, feature: str, case: str = "") -> Optional[Expectation]:
        """The entry for a test (the most specific of those matching its feature and case); ``nodeid``
        is what the caller has to hand (``certification.waivers``) and is not matched."""
        hits = [e for e in self.entries if e.matches(feature, case)]
        return max(hits, key=Expectation.rank) if hits else None

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"lora-conformance: expectations {self.path} ({len(self.entries)} entries)"

    # tryfirst: see every collected item before -k/-m deselect some of them.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config, items) -> None:
        from lora_conformance.certification import is_stale

        self.collected = True
        used: set[int] = set()
        suites: set[str] = set()
        for item in items:
            feature, case = item_feature_and_case(item)
            suites.add(feature.split("/", 1)[0])
            hits = [e for e in self.entries if e.matches(feature, case)]
            if not hits:
                continue
            used.update(e.index for e in hits)
            e = max(hits, key=Expectation.rank)
            if self.certified and is_stale(e):
                # Recorded against another suite version: it runs, and must still fail (a skip too,
                # bounded by the test time budget); an unexpected pass fails the case.
                item.add_marker(pytest.mark.xfail(reason=f"re-confirming (recorded against suite "
                                                         f"{e.recorded_against}): {e.describe()}", strict=True))
            elif e.status == "xfail":
                item.add_marker(pytest.mark.xfail(reason=e.describe(), strict=e.strict))
            else:
                item.add_marker(pytest.mark.skip(reason=e.describe()))
            self.applied[e.status] += 1
        for e in self.entries:
            if e.index not in used and e.feature.split("/", 1)[0] in suites:
                self.unmatched.append(e)
                warnings.warn(UnmatchedExpectationWarning(
                    f"{self.path} entry {e.index}: feature {e.label!r} matches no collected test"
                ))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.collected:  # an xdist controller: the workers did the matching
            return
        tr = terminalreporter
        tr.write_line(
            f"lora-conformance expectations {self.path}: {len(self.entries)} entries, "
            f"{self.applied['xfail']} tests marked xfail, {self.applied['skip']} skipped, "
            f"{len(self.unmatched)} unmatched"
        )
        for e in self.unmatched:
            tr.write_line(f"  unmatched entry {e.index}: {e.label}")
