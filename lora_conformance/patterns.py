"""PEFT's module-name patterns, matched as PEFT matches them but in bounded time.

PEFT (0.21) reads two kinds of patterns from ``adapter_config.json``:

- ``target_modules`` given as a string is a regular expression that must match the *whole*
  module name (``re.fullmatch``); a list names modules (or dot-bounded suffixes of names).
- each key of ``rank_pattern`` / ``alpha_pattern`` matches a dot-bounded suffix of the module
  name (``re.match(rf"(.*\\.)?({key})$", name)``); the first key that matches wins.

These are user-supplied regular expressions. Python's ``re`` backtracks without limit, so a key
like ``(.*.*)*z`` keeps PEFT busy for minutes on a 30-character module name (only Ctrl-C stops
it). Here every match runs on the ``regex`` package (its version 0 is ``re``'s syntax and
semantics, with a better matcher and a ``timeout``) under one time budget per adapter load: a
pattern that exhausts it is refused with an error naming the field, instead of hanging the
engine.
"""

from __future__ import annotations

import re
import time
from typing import Optional

# Seconds all pattern matching of one adapter may take (module names are short: a sane pattern
# takes microseconds per name), and one match. ``regex`` looks at the clock only now and then, so
# a timeout fires late (measured here: 4-10x late on a loaded 2-core host); the small per-match cap
# keeps a pathological key's refusal well inside the budget.
PATTERN_BUDGET_S = 1.0
MATCH_TIMEOUT_S = 0.02


class PatternError(ValueError):
    """A pattern that cannot be compiled, or that exhausted the matching budget."""


class PatternMatcher:
    """Matches PEFT's patterns against module names under one deadline; results are memoised."""

    def __init__(self, budget_s: Optional[float] = None):
        self.budget_s = PATTERN_BUDGET_S if budget_s is None else budget_s
        self._deadline = time.monotonic() + self.budget_s
        self._compiled: dict[str, object] = {}
        self._memo: dict[tuple[str, str, bool], bool] = {}

    def _compile(self, pattern: str):
        c = self._compiled.get(pattern)
        if c is None:
            import regex

            try:
                re.compile(pattern)  # what PEFT would compile: refuse what it refuses
                c = regex.compile(pattern, flags=regex.VERSION0)
            except (re.error, regex.error, TypeError) as exc:
                raise PatternError(f"not a valid regular expression ({exc})") from None
            self._compiled[pattern] = c
        return c

    def _match(self, pattern: str, name: str, full: bool) -> bool:
        key = (pattern, name, full)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        c = self._compile(pattern)
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            found = (c.fullmatch if full else c.match)(name, timeout=min(left, MATCH_TIMEOUT_S)) is not None
        except TimeoutError:
            raise PatternError(
                f"matching it against the module name {name!r} took more than {MATCH_TIMEOUT_S:g} s "
                "(catastrophic backtracking: nested or overlapping quantifiers such as (.*.*)* or (a|a)*); "
                "Python's re, which PEFT uses, would hang on it. Use a simpler pattern") from None
        self._memo[key] = found
        return found

    def target_matches(self, pattern: str, name: str) -> bool:
        """A string ``target_modules``: the whole module name must match."""
        return self._match(pattern, name, True)

    def pattern_key(self, patterns: dict, name: str) -> Optional[str]:
        """The first key of ``rank_pattern`` / ``alpha_pattern`` that matches ``name`` (PEFT's
        ``get_pattern_key``), or None."""
        for key in patterns:
            if self._match(rf"(.*\.)?({key})$", name, False):
                return key
        return None

    def value_for(self, patterns: dict, name: str, default):
        key = self.pattern_key(patterns, name)
        return default if key is None else patterns[key]
