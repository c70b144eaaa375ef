"""The audit inside every run (as MLPerf's TEST01 re-checks a sample of a run's outputs).

While the suites run, each passed case that judged a free-running decode leaves what it asked and
what the engine answered (``AuditCase``). At the end of the run a seeded random sample of them is
asked again, of a *fresh* engine with the same settings and adapters, in *reversed* batch order:
a correct engine answers the same (within the dtype's gross decode bounds, the free-running
check's). An engine that is not deterministic, that serves from state left by earlier requests
(a stale cache, an adapter slot not cleared) or whose rows depend on their batch neighbours
answers otherwise, and the run is not certified.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.types import GenerationRequest, GenerationResult

# Cases re-run per process: each costs one engine start (seconds for the built-in engine, about
# 20 s for vLLM on cpu) and one batch.
SAMPLE_PER_PROCESS = 2


@dataclass
class AuditCase:
    nodeid: str
    model_dir: Path
    dtype: str
    engine_args: dict[str, Any]  # the test's own engine args (on top of the user's)
    adapters: dict[str, Path]  # adapter name in the engine -> the directory it was loaded from
    requests: list[GenerationRequest]
    outputs: list[GenerationResult]
    passed: bool = False
    # each adapter directory's files as they were at the decode (``files_signature``): a case whose
    # directory was rewritten since (a test that reloads a path with new weights) cannot be asked again
    signatures: dict[str, tuple] = field(default_factory=dict)

    def __post_init__(self):
        if not self.signatures:
            self.signatures = {name: files_signature(path) for name, path in self.adapters.items()}

    def adapters_unchanged(self) -> bool:
        return all(files_signature(path) == self.signatures.get(name) for name, path in self.adapters.items())


def files_signature(directory: Path) -> tuple:
    """(name, size, mtime in ns) of each file in ``directory``: what changes when it is written again."""
    try:
        return tuple(sorted((f.name, st.st_size, st.st_mtime_ns)
                            for f in Path(directory).iterdir() if f.is_file() for st in (f.stat(),)))
    except OSError:
        return ()


@dataclass
class AuditResult:
    sampled: int = 0
    seed: int = 0
    cases: list[str] = field(default_factory=list)
    mismatches: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"sampled": self.sampled, "seed": self.seed, "cases": list(self.cases),
                "mismatches": list(self.mismatches)}


def sample(cases: Sequence[AuditCase], seed: int, k: int = SAMPLE_PER_PROCESS) -> list[AuditCase]:
    """Up to ``k`` of the passed cases whose adapter directories are as they were at the decode,
    chosen by ``seed`` (the report records it)."""
    passed = sorted((c for c in cases if c.passed and c.adapters_unchanged()), key=lambda c: c.nodeid)
    return random.Random(seed).sample(passed, min(k, len(passed)))


def replay(case: AuditCase, start_engine: Callable[[AuditCase], Any], judge) -> Optional[str]:
    """Ask a fresh engine ``case``'s requests in reversed order; None when it answers as the run's
    engine did, else what differs. ``judge``: a ``judge.checks.Judge`` of the case's dtype."""
    engine = start_engine(case)
    try:
        for name, path in case.adapters.items():
            engine.load_adapter(name, path)
        order = list(range(len(case.requests)))[::-1]
        answers = engine.generate([case.requests[i] for i in order])
        outputs: list[Optional[GenerationResult]] = [None] * len(order)
        for i, out in zip(order, answers):
            outputs[i] = out
    finally:
        engine.close()
    try:
        judge.free_running(outputs, case.outputs, case.requests, label=f"audit of {case.nodeid}")
    except (ConformanceAssertionError, AssertionError) as exc:
        return str(exc).splitlines()[0][:400]
    return None


def run(cases: Sequence[AuditCase], seed: int, start_engine: Callable[[AuditCase], Any],
        judge_for: Callable[[AuditCase], Any], k: int = SAMPLE_PER_PROCESS) -> AuditResult:
    """The audit of one process's passed cases (``judge_for(case)``: the Judge of its model and dtype)."""
    chosen = sample(cases, seed, k)
    result = AuditResult(sampled=len(chosen), seed=seed, cases=[c.nodeid for c in chosen])
    for case in chosen:
        try:
            problem = replay(case, start_engine, judge_for(case))
        except Exception as exc:  # noqa: BLE001 - an engine that cannot answer again is a finding too
            problem = f"the fresh engine failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if problem:
            result.mismatches.append({"nodeid": case.nodeid, "difference": problem})
    return result
