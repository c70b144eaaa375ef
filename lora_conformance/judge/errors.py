"""The failure type of every comparison: an AssertionError that carries its evidence."""

from __future__ import annotations

from typing import Any


class ConformanceAssertionError(AssertionError):
    """Raised by the comparison library.

    ``evidence`` is JSON-serialisable (plain dicts, lists, numbers, strings): the report
    stores it, and it crosses from pytest-xdist workers to the controller. Keys used:
    ``check`` (name of the comparison), ``tolerance``, ``dtype``, ``rows`` (per-slot
    details, e.g. token tables with margins), ``summary`` (one line).
    """

    def __init__(self, message: str, evidence: dict[str, Any]):
        super().__init__(message)
        self.evidence = evidence
