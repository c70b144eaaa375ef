"""The environment fingerprint of a run: what produced a result, for headers and reports."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from functools import lru_cache
from typing import Any, Optional

from lora_conformance import __version__
from lora_conformance.settings import Settings, repo_root


@lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "not installed"


def environment_fingerprint(settings: Settings, engine_version: Optional[str] = None) -> dict[str, Any]:
    from lora_conformance import devices

    return {
        "lora_conformance": __version__,
        "suite_version": __version__,
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "engine": settings.engine,
        "engine_version": engine_version,
        "engine_args": dict(settings.engine_args),
        "device": settings.device,
        "device_name": devices.device_name(settings.device),
        "driver": devices.driver_version(settings.device),
        "dtype": settings.dtype,
        "base_model": settings.base_model,
        "reference_device": settings.reference_device,
        "reference_dtype": settings.reference_dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
