"""The resolved settings of one run, kept on the pytest config under ``SETTINGS_KEY``.

Other parts (report, expectations, CI selection) read them with ``get_settings(config)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest


@dataclass
class Settings:
    device: str  # resolved: the type with its index where it has one
    device_spec: str  # as given on the command line (may be a bare type or auto)
    engine: str
    engine_args: dict[str, str]
    base_model: str
    dtype: str
    reference_device: str
    reference_dtype: str
    cache_dir: Path
    refresh_references: bool
    report_dir: Optional[Path]
    expectations: Optional[Path]
    ci_hw: Optional[str] = None
    ci_suite: Optional[str] = None
    ci_nightly: bool = False
    ci_partition: Optional[str] = None
    ci_durations: Optional[Path] = None
    threads: Any = None  # parallel.ThreadShare: torch threads of this process, and why
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "engine": self.engine,
            "engine_args": dict(self.engine_args),
            "base_model": self.base_model,
            "dtype": self.dtype,
            "reference_device": self.reference_device,
            "reference_dtype": self.reference_dtype,
            "cache_dir": str(self.cache_dir),
        }


SETTINGS_KEY = pytest.StashKey[Settings]()


def get_settings(config: pytest.Config) -> Settings:
    return config.stash[SETTINGS_KEY]


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("lora-conformance"))


def repo_root() -> Path:
    """The checkout holding suites/ and fixtures/ (the package is installed editable)."""
    return Path(__file__).resolve().parents[1]


def fixtures_dir() -> Path:
    import os

    env = os.environ.get("LORA_CONFORMANCE_FIXTURES")
    return Path(env) if env else repo_root() / "fixtures"


def suites_dir() -> Path:
    return repo_root() / "suites"
