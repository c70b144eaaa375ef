"""Ctrl-C (SIGINT) or SIGTERM to ``lora-conformance certify`` stops the run cleanly: pytest and
its pytest-xdist workers stop, the engines close (the server the openai engine started with a
server command is stopped), a partial report marked interrupted is written, and no process the
run started is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lora_conformance.processes import descendants as _descendants

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig,workers,inherited", [
    (signal.SIGINT, "1", "default"), (signal.SIGINT, "2", "default"),
    (signal.SIGTERM, "1", "default"), (signal.SIGTERM, "2", "default"),
    # started as a background job of a script (``certify ... &``, nohup) is: SIGINT ignored, which
    # pytest would inherit and so ignore the SIGINT that stops it (the run killed at the grace's end)
    (signal.SIGTERM, "2", "sigint-ignored"),
], ids=["SIGINT-1", "SIGINT-2", "SIGTERM-1", "SIGTERM-2", "SIGTERM-2-sigint-ignored"])
def test_an_interrupted_certify_leaves_nothing_running(tmp_path, cache, sig, workers, inherited):
    suites, ready = tmp_path / "suites", tmp_path / "ready"
    suites.mkdir()
    (suites / "test_hold.py").write_text(textwrap.dedent(f"""
        import pathlib, time

        def test_first():
            pass

        def test_hold(lora):
            lora.engine  # starts the server
            pathlib.Path({str(ready)!r}).write_text("ready")
            time.sleep(600)
    """))
    server_cmd = f"{sys.executable} {HERE / 'test_engine_openai.py'} --serve --host {{host}} --port {{port}} --model {{model}}"
    cmd = [sys.executable, "-m", "lora_conformance.cli", "certify", "--device", "cpu", "--engine", "openai",
           "--engine-arg", f"server_cmd={server_cmd}", "--engine-arg", "startup_timeout=120",
           "--report", str(tmp_path / "rep"), "--suite-dir", str(suites), "-n", workers,
           "--", "-p", "no:cacheprovider", f"--lora-cache={cache}", "-q"]
    if workers != "1":
        cmd += ["--dist", "load"]  # the two tests on two workers (a server engine would keep their file on one)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_ignore_sigint if inherited == "sigint-ignored" else None)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the held test never started"
            time.sleep(0.2)
        time.sleep(0.5)
        tree = _descendants(proc.pid)
        names = {pid: _cmdline(pid) for pid in tree}
        assert any("--serve" in c for c in names.values()), names  # the server is part of the run
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    time.sleep(0.3)
    left = {pid: names[pid] for pid in tree if _alive(pid)}
    assert not left, f"still running after certify returned: {left}\n{text[-3000:]}"
    assert proc.returncode != 0, text[-2000:]
    assert took < 60, f"certify took {took:.1f} s to stop\n{text[-4000:]}"
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["environment"].get("interrupted") is True, text[-2000:]
    ids = [r["nodeid"] for r in report["records"]]
    assert any(i.endswith("test_first") for i in ids), ids
