"""pytest side of CI registration: ``--ci-hw/--ci-suite/--ci-nightly/--ci-partition``.

The plugin registers ``CISelection(settings)`` when ``settings.ci_hw`` is set. Items from
files not registered for that hardware and suite (or registered as disabled) are
deselected; ``--ci-partition i/n`` then keeps shard ``i`` of the registered files, split
exactly as ``lora-conformance ci matrix`` splits them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest

from lora_conformance.ci import partition as part
from lora_conformance.ci.registry import Registration, RegistrationError, collect_file, display_path, select, suites_for


def _src(settings, name: str) -> str:
    source = getattr(settings, "sources", {}).get(name)
    return f" (from {source})" if source else ""


class CISelection:
    def __init__(self, settings):
        self.settings = settings
        self.hw: Optional[str] = settings.ci_hw
        self.suite: Optional[str] = settings.ci_suite
        self.nightly = bool(settings.ci_nightly)
        self.partition: Optional[tuple[int, int]] = None
        self.kept: list[Path] = []
        self.disabled: dict[Path, Registration] = {}
        self.durations_file: Optional[Path] = None
        self._validate()

    def _validate(self) -> None:
        s = self.settings
        if not self.hw:
            extra = [flag for flag, value in (("--ci-suite", s.ci_suite), ("--ci-partition", s.ci_partition),
                                              ("--ci-nightly", s.ci_nightly)) if value]
            if extra:
                raise pytest.UsageError(f"{', '.join(extra)} need --ci-hw (the hardware kind, e.g. cpu, cuda, xpu, npu)")
            return
        accepted = suites_for(self.hw)
        if not self.suite:
            raise pytest.UsageError(f"--ci-hw={self.hw!r} needs --ci-suite; accepted values for {self.hw}: "
                                    f"{', '.join(accepted)}")
        if self.suite not in accepted:
            raise pytest.UsageError(f"--ci-suite={self.suite!r}{_src(s, 'ci_suite')}: unknown suite for "
                                    f"--ci-hw={self.hw!r}; accepted values: {', '.join(accepted)}")
        if s.ci_partition:
            try:
                self.partition = part.parse_partition(s.ci_partition)
            except ValueError as exc:
                raise pytest.UsageError(f"--ci-partition={s.ci_partition!r}{_src(s, 'ci_partition')}: {exc}") from None

    # ---- hooks ----------------------------------------------------------------------

    def pytest_report_header(self, config):
        if not self.hw:
            return None
        shard = f" partition={self.partition[0]}/{self.partition[1]}" if self.partition else ""
        return f"ci: hw={self.hw} suite={self.suite} nightly={self.nightly}{shard}"

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        if not self.hw:
            return
        by_file: dict[Path, list] = {}
        for item in items:
            by_file.setdefault(Path(item.path), []).append(item)
        estimates: dict[Path, float] = {}
        for path in sorted(by_file):
            try:
                regs = collect_file(path)
            except RegistrationError as exc:
                raise pytest.UsageError(f"CI registration: {exc}") from None
            # select(): one registration per file, the suite's own before an included suite's.
            run, disabled = select({path: regs}, self.hw, self.suite, self.nightly)
            self.disabled.update(disabled)
            estimates.update({p: reg.est_time for p, reg in run.items()})
        keep = set(estimates)
        if self.partition and estimates:
            index, count = self.partition
            root = Path(os.path.commonpath([str(p.resolve().parent) for p in estimates]))
            self.durations_file = part.durations_path(getattr(self.settings, "ci_durations", None), root)
            durations = part.load_durations(self.durations_file) if self.durations_file else None
            keep = set(part.split(estimates, count, durations, root)[index][1])
        self.kept = sorted(keep)
        selected, deselected = [], []
        for item in items:
            (selected if Path(item.path) in keep else deselected).append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = selected

    def pytest_terminal_summary(self, terminalreporter):
        if not self.hw:
            return
        tr = terminalreporter
        tr.write_sep("-", f"ci selection: {self.hw}/{self.suite}")
        shard = f"shard {self.partition[0]}/{self.partition[1]}: " if self.partition else ""
        tr.write_line(f"{shard}{len(self.kept)} file(s) run"
                      + (f" (durations from {self.durations_file})" if self.durations_file else ""))
        for path, reg in sorted(self.disabled.items()):
            tr.write_line(f"disabled: {display_path(path)}: {reg.disabled}")
