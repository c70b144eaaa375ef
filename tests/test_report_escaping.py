"""Whatever a run supplies (test ids, messages, evidence, environment) is text in report.md and
report.html, never markup."""

from __future__ import annotations

import re

from lora_conformance.report.document import build_report
from lora_conformance.report.html import render_html
from lora_conformance.report.markdown import code, render_markdown, text
from lora_conformance.judge.verdict import verify

EVIL = '<img src=x onerror="alert(1)"><script>alert(2)</script>'


def _report():
    records = [{"nodeid": f"suites/test_x.py::test_a[{EVIL}`|`]", "phases": {"setup": "passed", "call": "failed"},
                "message": f"AssertionError: {EVIL}", "failure": {"type": "AssertionError", "message": EVIL},
                "evidence": {"check": "logprobs_close", "summary": EVIL, "rows": [{"engine_text": EVIL}]},
                "notes": None},
               {"nodeid": "suites/test_x.py::test_b", "phases": {"setup": "passed", "call": "passed"},
                "feature": {"id": "x/b", "description": EVIL}, "notes": [EVIL]}]
    env = {"engine": {"name": EVIL, "version": EVIL, "args": {"k": EVIL}}, "device": {"type": "cpu", "name": EVIL},
           "dtype": EVIL}
    report = build_report(env, records)
    return report, verify(report["records"])


def _outside_code_spans(md: str) -> str:
    # CommonMark: a code span's content is literal text (HTML in it is shown, not interpreted).
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", md)


def test_markdown_has_no_raw_html():
    report, verdict = _report()
    md = render_markdown(report, verdict)
    prose = _outside_code_spans(md)
    assert "<img" not in prose and "<script" not in prose, prose
    assert "&lt;img src=x" in prose  # shown, as text
    assert "`|`" not in prose, "a backtick in a test id does not end its code span"


def test_html_has_no_raw_html():
    report, verdict = _report()
    page = render_html(report, verdict)
    assert "<img" not in page and "<script" not in page
    assert "&lt;script&gt;" in page


def test_code_spans_cannot_be_closed_by_backticks():
    assert code("a`b") == "`` a`b ``"
    assert code("``x") == "``` ``x ```"
    assert code("plain") == "`plain`"
    assert text("a | b <i>") == "a \\| b &lt;i&gt;"
