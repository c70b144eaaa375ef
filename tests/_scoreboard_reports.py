"""Small stored reports for the scoreboard's tests: built with the report's own helpers
(``document.build_report``, ``signing.sign_report``, ``fileio.store_report``), never written by hand."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from lora_conformance.report.document import build_report

OK = {"setup": "passed", "call": "passed", "teardown": "passed"}
FAILED = {"setup": "passed", "call": "failed", "teardown": "passed"}
XFAILED = {"setup": "passed", "call": "skipped", "teardown": "passed"}

PASSING = "suites/test_accuracy.py::test_single_adapter_matches_reference[A]"
ROUTING = "suites/test_mixed_batch.py::test_nearest_reference_routing[2]"
DORA = "suites/test_dora.py::test_dora"
PINNING = "suites/test_pinning.py::test_pinned"
FEATURES = ("accuracy/single_adapter_matches_reference", "mixed_batch/nearest_reference_routing", "dora/dora",
            "pinning/pinned")
ISSUE = "https://github.com/example/engine/issues/7"
DIAGNOSIS = "closest to: base: rows got a wrong adapter (another one, or none)"  # root_causes' heading


def effects(nearest: str) -> list[dict]:
    points = [[x / 10, (x / 10) * (0.05 if nearest == "base" else 1.0)] for x in range(-8, 9)]
    return [{"label": "A", "plotted": points, "slope": 0.05 if nearest == "base" else 1.0, "slope_se": 0.01,
             "effect_rms": 0.5, "nearest": nearest, "distances": {"correct": 0.4, "base": 0.02}}]


def records(routing_fails: bool = True) -> list[dict]:
    routing = {"nodeid": ROUTING, "phases": OK}
    if routing_fails:
        routing = {"nodeid": ROUTING, "phases": FAILED, "effects": effects("base"),
                   "message": "ConformanceAssertionError: slot 1 got no adapter",
                   "evidence": {"check": "nearest_reference_routing", "rows": [
                       {"slot": 0, "expected": "A", "nearest": "A", "ok": True},
                       {"slot": 1, "expected": "B", "nearest": "__base__", "ok": False}]}}
    return [
        {"nodeid": PASSING, "phases": OK, "effects": effects("correct")},
        routing,
        {"nodeid": DORA, "phases": XFAILED, "wasxfail": f"DoRA is not supported ({ISSUE})"},
        {"nodeid": PINNING, "phases": {"setup": "skipped"}, "skip_reason": "engine does not declare pinning",
         "outcome": {"status": "not certified", "cause": "capability", "detail": "engine does not declare pinning"}},
    ]


def environment(engine: str = "vllm", device: str = "cuda", dtype: str = "bfloat16", date: str = "",
                suite: str = "0.1.0", args: dict | None = None) -> dict:
    return {"engine": {"name": engine, "version": f"{engine} 1.0", "args": args or {}},
            "device": {"type": device, "name": f"{device}:0"}, "dtype": dtype, "suite_version": suite,
            "date": date or "2030-" + "01-01T00:00:00+00:00"}


def certification(mode: str = "certified", suite: str = "0.1.0") -> dict:
    return {"mode": mode, "suite_version": suite, "suite_sha256": None, "expectations": None,
            "waived": [{"nodeid": DORA, "feature": "dora/dora", "status": "xfail", "issue": ISSUE,
                        "recorded_against": suite, "stale": False, "reconfirmed": None}],
            "audit": {"sampled": 2, "mismatches": []}}


def report(mode: str | None = "certified", routing_fails: bool = True, partial: bool = False, **env) -> dict:
    """A report; ``mode`` None: one from before certified mode (no certification block)."""
    suite = env.get("suite", "0.1.0")
    selection = {"declared_features": list(FEATURES) + (["extra/not_run"] if partial else []),
                 "suite": {"version": suite, "files": {}}}
    cert = certification(mode, suite) if mode else None
    return build_report(environment(**env), records(routing_fails), selection, cert)


def store(data: dict, path: Path) -> Path:
    """Write ``data`` as ``path`` says: ``.json``, ``.json.gz`` or ``.json.xz`` (``fileio.store_report``)."""
    from lora_conformance.fileio import store_report

    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1) + "\n"
    if path.name.endswith(".json.gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif path.name.endswith(".json.xz"):
        plain = path.with_name(path.name[:-3] + ".tmp")
        plain.write_text(text)
        store_report(plain, path)
        plain.unlink()
    else:
        path.write_text(text)
    return path


def keypair(where: Path, name: str = "vendor") -> tuple:
    """(private key object, public key file) made by ``signing.generate_keypair``."""
    from lora_conformance.report import signing

    where.mkdir(parents=True, exist_ok=True)
    private, public = where / f"{name}.key", where / f"{name}.pub"
    signing.generate_keypair(private, public)
    return signing._load_key(private, private=True), public


def signed(data: dict, private_key) -> dict:
    from lora_conformance.report.signing import sign_report

    return sign_report(data, private_key)
