"""What a certified run is: the rules a published badge requires (``certify --certified``,
``pytest suites --lora-certified``; docs/certifying.md is the program around them).

- **The whole suite, as released**: the bundled suites (the package's ``suites``, whose version is
  the package's), nothing narrowed: no ``-k``, ``-m``, ``--deselect``, ``--ignore``, node ids or
  other paths, ``--lf``/``--ff``, ``--sw``, ``-x``/``--maxfail``. A run asked to narrow refuses to start.
- **Waivers with an owner and an age**: every expectations entry (xfail or skip) names the filed
  upstream issue (``link``) and the suite version it was recorded against (``recorded_against``);
  a file with an entry that lacks either is refused, naming the file, the entry and the field.
- **Re-confirmed when the suite moves**: an entry recorded against another suite version runs (a
  skip becomes a strict xfail, bounded by the test time budget) and must still fail; one that no
  longer fails keeps the run from being certified (``judge.verdict``).
- **An audit**: every run, certified or not, re-runs a sample of passed cases on a fresh engine in
  another batch order (``judge.audit``); a difference fails the run.

This module is policy only: who may start, which entries are valid, which are stale. The verdict
that follows from it is the judge's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

CERTIFIED, OPEN = "certified", "open"
# pytest arguments a certified run may still be given: they change what is printed, not what runs.
OUTPUT_ONLY = ("-q", "-qq", "-v", "-vv", "-s", "--quiet", "--verbose", "--color=yes", "--color=no", "-ra", "-rA",
               "-rf", "-rs", "-rx", "--tb=short", "--tb=long", "--tb=line", "--tb=no", "--no-header")


def suite_version() -> str:
    """The version of the bundled suites: the package's (they ship inside it)."""
    import lora_conformance

    return lora_conformance.__version__


def launch_refusal(pytest_args: Sequence[str], suite_dir: Optional[Path]) -> Optional[str]:
    """Why ``certify --certified`` must not start with these arguments (None: it may)."""
    if suite_dir is not None:
        return "--suite-dir: a certified run runs the bundled suites, as released"
    narrowing, args = [], list(pytest_args)
    while args:
        arg = args.pop(0)
        if arg in ("-n", "--numprocesses", "--dist"):
            args = args[1:]  # its value
        elif arg not in OUTPUT_ONLY and not arg.startswith(("-n", "--numprocesses=", "--dist=")):
            narrowing.append(arg)
    if narrowing:
        return (f"pytest arguments {' '.join(narrowing)}: a certified run may not narrow or change the suite "
                f"(allowed after --: {', '.join(OUTPUT_ONLY)}, -n, --dist)")
    return None


def run_refusal(config: Any, bundled_suites: Path) -> Optional[str]:
    """Why a pytest run with ``--lora-certified`` must not start (None: it may): it is narrowed
    (the options ``report.selection.describe`` records) or runs anything but the bundled suites."""
    opt = config.option
    given = [name for name, value in (
        ("-k", getattr(opt, "keyword", "")), ("-m", getattr(opt, "markexpr", "")),
        ("--deselect", getattr(opt, "deselect", None)), ("--ignore", getattr(opt, "ignore", None)),
        ("--ignore-glob", getattr(opt, "ignore_glob", None)), ("--lf", getattr(opt, "lf", False)),
        ("--ff", getattr(opt, "failedfirst", False)), ("--sw", getattr(opt, "stepwise", False)),
        ("--sw-skip", getattr(opt, "stepwise_skip", False)), ("-x/--maxfail", getattr(opt, "maxfail", 0)),
    ) if value]
    if given:
        return f"{', '.join(given)}: a certified run may not narrow the suite"
    bundled = Path(bundled_suites).resolve()
    for arg in config.args:
        path, sep, _ = str(arg).partition("::")
        resolved = (Path(config.invocation_params.dir) / path).resolve()
        if sep or resolved != bundled:
            return (f"{arg}: a certified run runs the bundled suites ({bundled}) whole, not another path "
                    "or a node id")
    return None


def entry_refusal(entry: Any) -> Optional[str]:
    """Why an expectations entry cannot waive a case in a certified run (None: it can)."""
    if not entry.link:
        return "field 'link' is missing; a certified run's waiver names the filed upstream issue (an http(s) URL)"
    if not entry.recorded_against:
        return ("field 'recorded_against' is missing; a certified run's waiver names the suite version it was "
                f"recorded against (this suite is {suite_version()})")
    return None


def is_stale(entry: Any) -> bool:
    """The entry was recorded against another suite version: it must be re-confirmed in the run."""
    return bool(entry.recorded_against) and entry.recorded_against != suite_version()


def waivers(records: Iterable[Any], lookup, mode: str) -> list[dict[str, Any]]:
    """The report's waivers: one per case an expectations entry waived (``lookup(nodeid, feature,
    case)`` gives the entry), with whether a stale one was re-confirmed (it ran and still failed)."""
    from lora_conformance.features import feature_of

    out = []
    for rec in records:
        feature = (rec.feature or {}).get("id") if isinstance(rec.feature, dict) else None
        feature = feature or feature_of(rec.nodeid)[1]
        case = rec.nodeid.split("[", 1)[1].rstrip("]") if "[" in rec.nodeid else ""
        entry = lookup(rec.nodeid, feature, case)
        if entry is None:
            continue
        stale = is_stale(entry)
        xfailed = rec.wasxfail is not None and "skipped" in (rec.phases.get("setup"), rec.phases.get("call"))
        out.append({"nodeid": rec.nodeid, "feature": feature, "status": entry.status, "issue": entry.link,
                    "recorded_against": entry.recorded_against or None, "stale": stale,
                    "reconfirmed": (xfailed if stale and mode == CERTIFIED else None)})
    return out
