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
    certified: bool = False  # --lora-certified (lora_conformance.certification)
    ci_hw: Optional[str] = None
    ci_suite: Optional[str] = None
    ci_nightly: bool = False
    ci_partition: Optional[str] = None
    ci_durations: Optional[Path] = None
    test_timeout: float = 0.0  # seconds per test phase (0: no budget; see lora_conformance.time_budget)
    profile: str = "fast"  # models/profiles.py: the shapes the suites certify
    threads: Any = None  # parallel.ThreadShare: torch threads of this process, and why
    sources: dict[str, str] = field(default_factory=dict)
    base_quant: str = "none"  # models.quant scheme of the decoder bases (none: float)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "engine": self.engine,
            "engine_args": dict(self.engine_args),
            "base_model": self.base_model,
            "base_quant": self.base_quant,
            "dtype": self.dtype,
            "reference_device": self.reference_device,
            "reference_dtype": self.reference_dtype,
            "cache_dir": str(self.cache_dir),
            "profile": self.profile,
        }


SETTINGS_KEY = pytest.StashKey[Settings]()
# -n auto's choice (parallel.WorkerChoice), left by the plugin's xdist hook for the run's header.
WORKER_CHOICE_KEY = pytest.StashKey[object]()


def get_settings(config: pytest.Config) -> Settings:
    return config.stash[SETTINGS_KEY]


def check_writable_dirs(settings: Settings) -> None:
    """A read-only (or full) cache or report directory stops the run before any work, as a usage
    error naming the directory, instead of failing tests as if the engine were at fault or losing
    the report at the end."""
    from lora_conformance.fileio import CacheEnvironmentError, check_writable_dir

    try:
        check_writable_dir(settings.cache_dir, "the lora-conformance cache (--lora-cache)")
        if settings.report_dir is not None:
            check_writable_dir(settings.report_dir, "the report directory (--lora-report)",
                               "the report is written there at the end: give a writable --lora-report")
    except CacheEnvironmentError as exc:
        raise pytest.UsageError(str(exc)) from None


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("lora-conformance"))


def repo_root() -> Optional[Path]:
    """The source checkout the package runs from (editable install, or PYTHONPATH), whose git commit
    the report records; None for a plain install (site-packages may sit inside some other project's
    git work tree, whose commit says nothing about this package)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "suites").is_dir() else None


def shipped_dir(name: str) -> Path:
    """A folder that ships inside the package as ``lora_conformance.<name>`` (``suites``, ``fixtures``).

    In a plain install that is the installed package's folder. A source checkout keeps the folder at
    its top (pyproject.toml maps it into the package), and its own copy wins there: a run from the
    checkout without reinstalling (PYTHONPATH, or an editable install made before the folder
    shipped) finds no such package, or finds another checkout's through that editable install.
    """
    import importlib.util

    here = Path(__file__).resolve().parent
    try:
        spec = importlib.util.find_spec(f"lora_conformance.{name}")
    except ImportError:
        spec = None
    installed = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if installed is not None and installed.resolve().parent == here:
        return installed  # inside this package (a wheel install)
    source = here.parent / name
    if (here.parent / "pyproject.toml").is_file() and source.is_dir():
        return source
    if installed is not None:
        return installed
    raise FileNotFoundError(f"lora_conformance.{name} is not installed with the package, and {source} does not "
                            "exist: reinstall lora-conformance")


def fixtures_dir() -> Path:
    import os

    env = os.environ.get("LORA_CONFORMANCE_FIXTURES")
    return Path(env) if env else shipped_dir("fixtures")


def suites_dir() -> Path:
    """The bundled conformance suites (``lora_conformance.suites``)."""
    return shipped_dir("suites")
