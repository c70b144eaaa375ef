"""report.html in a real headless browser: it renders offline, logs nothing to the console,
and the screenshot shows the feature matrix with every status colour."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from _report_png import read_png
from lora_conformance.report.document import build_report, write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
WIDTH, HEIGHT = 1280, 1500

# Background colours of the status pills and of a differing token (template.html).
COLOURS = {
    "passed": (0xD7, 0xF0, 0xDA),
    "failed": (0xF9, 0xD6, 0xD5),
    "error": (0xF3, 0xC4, 0xE4),
    "xfail": (0xFB, 0xE9, 0xC0),
    "not certified": (0xE3, 0xE3, 0xE3),
    "skipped": (0xEE, 0xF2, 0xF7),
    "token diff": (0xFF, 0xCD, 0xD2),
}


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: install Debian's `chromium` package (apt-get install -y chromium)")


def render(page: Path, shot: Path, profile: Path) -> subprocess.CompletedProcess:
    """Screenshot ``page`` with the network unreachable; console messages go to stderr."""
    return subprocess.run([
        browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
        f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
        "--enable-logging=stderr", "--v=0", f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={shot}",
        page.as_uri(),
    ], capture_output=True, text=True, timeout=120)


def console_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


OK = {"setup": "passed", "call": "passed", "teardown": "passed"}


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    records = [
        {"nodeid": "suites/test_mixed_batch.py::test_nearest_reference_routing[2]", "phases": OK},
        {"nodeid": "suites/test_greedy.py::test_greedy_tokens[1]", "phases": {"setup": "passed", "call": "failed"},
         "message": "ConformanceAssertionError: greedy tokens differ at step 1",
         "evidence": {"check": "greedy_tokens", "summary": "step 1 differs", "tolerance": 0.05, "rows": [
             {"step": 0, "reference_text": "the", "reference_margin": 2.5, "engine_text": "the", "same": True},
             {"step": 1, "reference_text": "cat", "reference_margin": 0.01, "engine_text": "dog", "same": False}]}},
        {"nodeid": "suites/test_loading.py::test_reload", "phases": {"setup": "failed"}, "message": "RuntimeError"},
        {"nodeid": "suites/test_dora.py::test_dora", "phases": {"setup": "passed", "call": "skipped"},
         "wasxfail": "engine bug #41"},
        {"nodeid": "suites/test_pinning.py::test_pinned", "phases": {"setup": "skipped"},
         "skip_reason": "not certified: engine does not declare pinning"},
        {"nodeid": "suites/test_graphs.py::test_replay", "phases": {"setup": "skipped"},
         "skip_reason": "not applicable on cpu"},
    ]
    env = {"engine": {"name": "fake", "version": "1.0"}, "device": {"name": "xpu:0", "type": "xpu"},
           "dtype": "bfloat16"}
    return write_report(build_report(env, records), out)["report.html"]


def test_console_capture_works(tmp_path):
    """Control: a page that logs an error is caught, so a clean run below means something."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><p>x</p><script>console.error('boom'); nope();</script></body></html>")
    done = render(page, tmp_path / "bad.png", tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = console_lines(done)
    assert any("boom" in line for line in lines) and any("nope is not defined" in line for line in lines)


def test_report_renders_cleanly_and_shows_the_matrix(report_page, tmp_path):
    shot = tmp_path / "report.png"
    done = render(report_page, shot, tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert console_lines(done) == []
    pixels = read_png(shot.read_bytes())[:, :, :3]
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    for status, colour in COLOURS.items():
        mask = (pixels == np.array(colour)).all(axis=-1)
        assert mask.sum() > 100, f"no {status} colour in the screenshot"
        if status != "token diff":
            # Each status shows in the summary line and again in its matrix row, lower down.
            rows = np.flatnonzero(mask.any(axis=1))
            assert rows.max() - rows.min() > 40, f"{status} appears in one place only"


def test_report_is_self_contained(report_page):
    html = report_page.read_text()
    lowered = html.lower()
    assert "<script" not in lowered and "<link" not in lowered and "@import" not in lowered and "url(" not in lowered
    assert "src=" not in lowered
    assert lowered.count("http") == lowered.count('xmlns="http://www.w3.org/2000/svg"')
