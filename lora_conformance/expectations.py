"""Expectation files: known engine failures as data, matched by test-id prefix.

A vendor keeps one TOML file per engine (and device type), in the style of array-api-tests'
skips/xfails files and ONNX backend-test filters::

    # ---- prompt logprobs with LoRA in multi-request batches (vLLM CPU) ----
    [[expect]]
    id = "suites/test_logprobs.py::test_prompt_logprobs[mixed"
    status = "xfail"          # "xfail" (strict: an unexpected pass fails) or "skip" (not run)
    # strict = false          # optional, xfail only: the failure depends on engine state
    reason = "LogitsProcessorWithLoRA indexes prompt rows per request"
    link = "https://github.com/vllm-project/vllm/issues/NNNN"   # or ""

Matching: an entry applies to every collected test whose node id equals ``id`` or starts
with it at a boundary (the id ends with ``/ : [ - ]``, or the next character of the node
id is one of ``/ : [ -``), so ``...::test_x`` never catches ``...::test_x_other``.
When several entries match, the longest id wins. Entries matching nothing are reported
(a pytest warning and a terminal-summary line) when their file was part of the run or
does not exist, so stale entries surface without noise from partial runs.

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
FIELDS = ("id", "status", "reason", "link", "strict")
PACKAGED_DIR = Path(__file__).parent / "expectations"
_BOUNDARY_END = "/:[-]"
_BOUNDARY_NEXT = "/:[-"


class UnmatchedExpectationWarning(pytest.PytestWarning):
    """An expectation entry matched no collected test (stale or misspelled id)."""


@dataclass(frozen=True)
class Expectation:
    id: str
    status: str
    reason: str
    link: str
    index: int  # 1-based position in the file, for messages
    # xfail only: False for a failure that depends on engine state (an unexpected pass is reported,
    # not failed). Default True.
    strict: bool = True

    def matches(self, nodeid: str) -> bool:
        if nodeid == self.id:
            return True
        if not nodeid.startswith(self.id):
            return False
        return self.id[-1] in _BOUNDARY_END or nodeid[len(self.id)] in _BOUNDARY_NEXT

    def describe(self) -> str:
        return f"expected: {self.reason}" + (f" ({self.link})" if self.link else "")


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
    seen: dict[str, int] = {}
    for i, raw in enumerate(entries, start=1):
        out.append(_entry(path, i, raw))
        if out[-1].id in seen:
            raise _bad(path, f"entry {i}", f"field 'id': {out[-1].id!r} repeats entry {seen[out[-1].id]}")
        seen[out[-1].id] = i
    return out


def _entry(path: Path, i: int, raw: dict[str, Any]) -> Expectation:
    where = f"entry {i}"
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise _bad(path, where, f"unknown field(s) {', '.join(unknown)}; expected fields: {', '.join(FIELDS)}")
    for field in ("id", "status", "reason"):
        value = raw.get(field)
        if not isinstance(value, str) or not value.strip():
            raise _bad(path, where, f"field {field!r} is {'missing' if value is None else repr(value)}; "
                                    f"expected a non-empty string")
    if raw["status"] not in STATUSES:
        raise _bad(path, where, f"field 'status' is {raw['status']!r}; expected one of {', '.join(STATUSES)}")
    link = raw.get("link", "")
    if not isinstance(link, str) or (link and not re.match(r"https?://\S+$", link)):
        raise _bad(path, where, f"field 'link' is {link!r}; expected an http(s) URL or an empty string")
    strict = raw.get("strict", True)
    if not isinstance(strict, bool) or (not strict and raw["status"] != "xfail"):
        raise _bad(path, where, f"field 'strict' is {strict!r}; expected true or false (false only with status xfail)")
    return Expectation(id=raw["id"].strip(), status=raw["status"], reason=raw["reason"].strip(), link=link, index=i,
                       strict=strict)


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

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = load_expectations(self.path)
        self.applied: dict[str, int] = {"xfail": 0, "skip": 0}
        self.unmatched: list[Expectation] = []
        self.collected = False

    def lookup(self, nodeid: str) -> Optional[Expectation]:
        best = None
        for e in self.entries:
            if e.matches(nodeid) and (best is None or len(e.id) > len(best.id)):
                best = e
        return best

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"lora-conformance: expectations {self.path} ({len(self.entries)} entries)"

    # tryfirst: see every collected item before -k/-m deselect some of them.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config, items) -> None:
        self.collected = True
        used: set[int] = set()
        for item in items:
            hits = [e for e in self.entries if e.matches(item.nodeid)]
            if not hits:
                continue
            used.update(e.index for e in hits)
            e = max(hits, key=lambda h: len(h.id))
            if e.status == "xfail":
                item.add_marker(pytest.mark.xfail(reason=e.describe(), strict=e.strict))
            else:
                item.add_marker(pytest.mark.skip(reason=e.describe()))
            self.applied[e.status] += 1
        files = {item.nodeid.split("::", 1)[0] for item in items}
        for e in self.entries:
            if e.index in used:
                continue
            file_part = e.id.split("::", 1)[0]
            in_run = any(f == file_part or f.startswith(file_part.rstrip("/") + "/") for f in files)
            if in_run or not (config.rootpath / file_part).exists():
                self.unmatched.append(e)
                warnings.warn(UnmatchedExpectationWarning(
                    f"{self.path} entry {e.index}: id {e.id!r} matches no collected test"
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
            tr.write_line(f"  unmatched entry {e.index}: {e.id}")
