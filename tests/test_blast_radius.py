"""Blast radius: one narrow defect turns red the features of that defect, and no others.

Each engine in ``_defective_engines`` is the correct built-in engine with one thing wrong.
A suite that asks every test for an auxiliary feature (prompt logprobs, embeddings, ...)
makes one bug fail many features, and a certification matrix whose cells share one cause
tells a vendor less than its colours suggest. Each case runs only the suites in
which its defect can show (in-process through pytester, the session's reference cache
shared) and compares the features that turned red, by feature id, with the defect's own.

Where the suites do not isolate a defect yet, the case is a strict xfail that names the
number of features red today: when the suites are fixed it passes, and the strict xfail
fails until the marker is removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from _feature_runs import red_features
from lora_conformance.settings import suites_dir


@dataclass(frozen=True)
class Defect:
    engine: str  # a class in tests/_defective_engines.py
    suites: tuple[str, ...]  # the suite files in which the defect can show
    red: frozenset[str]  # the features it must turn red: its own, at most two
    select: str = ""  # -k expression, where one suite file holds far more than the defect can touch
    today: str = ""  # xfail reason while the suites turn more (or fewer) features red


DEFECTS = {
    # Only the test that certifies prompt logprobs asks for them unconditionally (the others are
    # teacher-forced); chunked prefill and backends use them as an auxiliary feature only after a
    # probe found them working (TestContext.prompt_logprobs_shown_to_work), else they compare the decode alone.
    "prompt_logprobs_fail": Defect(
        "PromptLogprobsFail", ("test_accuracy.py", "test_adapter_semantics.py", "test_chunked_prefill.py",
                               "test_backends.py"),
        frozenset({"accuracy/prefill_logprobs_with_adapter"})),
    "rank_one_refused": Defect(
        "RankOneRefused", ("test_adapter_semantics.py",), frozenset({"adapter_semantics/rank"}),
        select="rank"),
    # The other embeddings tests are not certified when embed() refuses (test_embeddings.BASIC).
    "embeddings_refused": Defect(
        "EmbeddingsRefused", ("test_embeddings.py",), frozenset({"embeddings/matches_reference"})),
    # Always lru: only a test that asks for fifo can see it, through the residency the engine reports.
    "eviction_policy_ignored": Defect(
        "EvictionPolicyIgnored", ("test_lifecycle.py",), frozenset({"lifecycle/eviction_and_reload"}),
        select="eviction_and_reload and fifo"),
}


def test_every_defect_is_narrow():
    for name, d in DEFECTS.items():
        assert 1 <= len(d.red) <= 2, f"{name}: a narrow defect owns one or two features, not {sorted(d.red)}"


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=d.today) if d.today else ())
    for n, d in DEFECTS.items()])
def test_defect_turns_only_its_own_features_red(suite_runner, lora_settings, name):
    d = DEFECTS[name]
    args = [str(suites_dir() / f) for f in d.suites]
    if d.select:
        args += ["-k", d.select]
    result = suite_runner.runpytest(
        *args, f"--engine=_defective_engines:{d.engine}", "--device=cpu", "--dtype=float32",
        f"--lora-cache={lora_settings.cache_dir}", "-p", "no:cacheprovider", "-q")
    red = red_features(result)
    assert set(red) == set(d.red), (
        f"{name}: features red {sorted(red)} ({len(red)}), expected exactly {sorted(d.red)}; failing cases: "
        + "; ".join(f"{f}: {', '.join(c)}" for f, c in sorted(red.items())) + "\n" + "\n".join(result.outlines[-15:]))
