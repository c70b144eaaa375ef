"""Structured test outcomes beyond pass / fail: *not certified*, with its cause.

A suite test that cannot judge the engine says why in one of a few words, not in free text:

- ``capability``: the engine does not declare a capability the feature needs;
- ``limit``: a declared limit is too small for the test (``needs 5 loaded adapters, engine allows 3``);
- ``refused``: the engine refused the configuration or the model the test needs.

``not_certified(cause, detail)`` skips the test with a ``NotCertified`` exception (a pytest
skip, so every runner treats it as one); the report reads the cause from the exception (the
plugin records it as ``lora_conformance.evidence.OUTCOME``), not from the message text. The
message keeps the ``not certified: ...`` form for people and for reports written before the
cause was recorded.
"""

from __future__ import annotations

from typing import Mapping, NoReturn

import pytest

CAPABILITY, LIMIT, REFUSED = "capability", "limit", "refused"
CAUSES = (CAPABILITY, LIMIT, REFUSED)


class NotCertified(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A skip that means: this feature was not shown to work on this engine."""

    def __init__(self, cause: str, detail: str):
        if cause not in CAUSES:
            raise ValueError(f"unknown not-certified cause {cause!r}; expected one of {', '.join(CAUSES)}")
        self.cause = cause
        self.detail = detail
        super().__init__(f"not certified: {detail}")

    def as_dict(self) -> dict[str, str]:
        return {"status": "not certified", "cause": self.cause, "detail": self.detail}


def not_certified(cause: str, detail: str) -> NoReturn:
    raise NotCertified(cause, detail)


def missing_capabilities(caps: "list[str] | tuple[str, ...]", reasons: "Mapping[str, str] | None" = None) -> NoReturn:
    """Not certified: the engine does not declare ``caps``; ``reasons`` (capability -> the evidence the
    engine's plugin gives for not declaring it) are shown with them."""
    reasons = reasons or {}
    shown = [f"{c} ({reasons[c]})" if reasons.get(c) else c for c in caps]
    not_certified(CAPABILITY, f"engine does not declare {'; '.join(shown)}")


def limit_too_small(what: str, needed: int, allowed: int) -> NoReturn:
    not_certified(LIMIT, f"needs {needed} {what}, engine allows {allowed}")
