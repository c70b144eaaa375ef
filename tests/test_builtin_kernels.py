"""The fused decode kernels under Triton's cpu interpreter, in a process of their own.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton's first import, and peft
imports triton, so tests/kernels_interpreted.py runs in a fresh pytest process. Its own
summary must show every one of its tests passed: a skip or an empty collection is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_kernels_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(HERE / "kernels_interpreted.py"), "-q", "-rfEs",
                           "-p", "no:cacheprovider", "-p", "no:xdist"],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    summary = lines[-1] if lines else "(no pytest summary line)"
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) passed", summary)
    assert m and int(m.group(1)) >= 20, summary
    assert not re.search(r"failed|skipped|error|deselected", summary), summary
