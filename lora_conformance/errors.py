"""The typed errors an engine raises on purpose (re-exported by ``lora_conformance.engines.base``),
and those of reading a stored report.

Standard library only: the adapter validator, the engines and the plugin all raise or catch
them, so they sit below every one of those layers.
"""

from __future__ import annotations

from typing import Sequence


class EngineError(Exception):
    """Base of every error an engine raises on purpose."""


class AdapterNotLoadedError(EngineError, KeyError):
    def __init__(self, name: str, loaded: Sequence[str] = ()):
        self.name = name
        self.loaded = list(loaded)
        super().__init__(f"adapter {name!r} is not loaded (loaded: {', '.join(self.loaded) or 'none'})")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class AdapterIncompatibleError(EngineError, ValueError):
    """The adapter cannot be served by this engine (rank too large, unknown target module, ...)."""


class AdapterFormatError(AdapterIncompatibleError):
    """The adapter directory is malformed, or does not fit the base model or the engine's limits.

    ``file`` is the offending file (or the directory), ``field`` the config field or tensor name.
    """

    def __init__(self, file, field: str, problem: str):
        self.file, self.field, self.problem = str(file), field, problem
        super().__init__(f"{self.file}: {field}: {problem}")


class CapacityError(EngineError, RuntimeError):
    """No slot can be found: every slot pinned, or pinning would starve unpinned requests."""


class UnsupportedFeatureError(EngineError, NotImplementedError):
    """The adapter or request uses a feature the engine refuses (DoRA, modules_to_save, ...)."""


class EngineFailure(EngineError, RuntimeError):
    """The engine broke (crashed worker, server error, timeout)."""


class AdapterInUseError(EngineError, RuntimeError):
    """Unloading or replacing an adapter that running requests use is refused (an engine may wait instead)."""

    def __init__(self, name: str, requests: int):
        self.name, self.requests = name, requests
        super().__init__(f"adapter {name!r} is used by {requests} running request(s); retry when they finish")


# ---- reading a report ---------------------------------------------------------------------


class ReportFormatError(ValueError):
    """A file that is not a readable report (names the file and what is wrong)."""


class ReportDigestError(ReportFormatError):
    """The report does not match its digest (edited, damaged, or no digest)."""
