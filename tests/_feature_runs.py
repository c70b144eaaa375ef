"""Running suite features by id, in this process (tests/conftest.py's ``suite_runner``), and reading
which of them turned red: the detection-power and blast-radius tests speak of features, never of
test functions, so a renamed test function changes neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from lora_conformance.evidence import FEATURE
from lora_conformance.features import declared_in_source, item_feature_id
from lora_conformance.settings import suites_dir


def declared_features() -> dict[str, Path]:
    """Feature id -> the suite file that declares it (its ``feature`` markers, read from the source)."""
    return {fid: path for path in sorted(suites_dir().glob("test_*.py"))
            for fid in declared_in_source(path.read_text())}


def files_declaring(features: Iterable[str]) -> list[str]:
    """The suite files to run for ``features``; KeyError names a feature no suite declares."""
    declared = declared_features()
    return sorted({str(declared[f]) for f in features})


class KeepFeatures:
    """A pytest plugin for the run: deselects every collected case whose feature is not one of ``features``."""

    def __init__(self, features: Iterable[str]):
        self.features = set(features)

    def pytest_collection_modifyitems(self, config, items) -> None:
        kept = [i for i in items if item_feature_id(i) in self.features]
        dropped = [i for i in items if item_feature_id(i) not in self.features]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def feature_of_report(report) -> str:
    """The feature a test report belongs to (the plugin's evidence), else its node id."""
    props = dict(p for p in report.user_properties if isinstance(p, tuple) and len(p) == 2)
    return json.loads(props[FEATURE])["id"] if FEATURE in props else report.nodeid


def red_features(result, when: Iterable[str] = ("setup", "call", "teardown")) -> dict[str, list[str]]:
    """Feature -> its failed cases (``file::case``) in a pytester ``result``, of the phases ``when``."""
    red: dict[str, list[str]] = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):
        if report.failed and report.when in tuple(when):
            red.setdefault(feature_of_report(report), []).append(report.nodeid.split("::", 1)[-1])
    return red
