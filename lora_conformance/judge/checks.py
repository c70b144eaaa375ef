"""The verdict of one suite test: what the ``lora`` fixture's ``assert_*`` methods decide.

``Judge`` holds what a verdict needs and nothing of how outputs were obtained: the dtype's
tolerance at the base's scale, the reference runner (for the paired effects' teacher-forced contexts and for token
text in messages) and where the evidence goes. The fixture (``lora_conformance.context``) gets
the engine's outputs and the reference's and hands them here; data flows one way:
suite -> context (engines, references) -> judge -> evidence.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from lora_conformance.judge import paired
from lora_conformance.judge.effects import assert_effects_conform
from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.logprobs import assert_logprobs_close, assert_prompt_logprobs_close
from lora_conformance.judge.rouge import assert_rouge_l
from lora_conformance.judge.tolerances import Tolerance, same_engine_tolerance_for, tolerance_for
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

# score(i, step, ids): the reference's logprobs of ``ids`` at decode step ``step`` of the i-th reference, or None
Scorer = Callable[[int, int, list[int]], Optional[TopK]]


class Judge:
    """One test's judge. ``runner``: the reference runner of the test's base model;
    ``record_effects``: called with the paired analyses' evidence before they are judged."""

    def __init__(self, dtype: str, runner: Any, record_effects: Callable[[list], None], scale: str = "small",
                 activations: Optional[str] = None):
        self.dtype = dtype
        self.runner = runner
        self.scale = scale  # the base's scale class (judge.tolerances.scale_of_config)
        # the engine's activation scheme in its quantised-base matmuls (Engine.declared_activations; None: float)
        self.activations = activations
        self._record_effects = record_effects

    @property
    def tolerance(self) -> Tolerance:
        return tolerance_for(self.dtype, self.scale, self.activations)

    @property
    def same_engine_tolerance(self) -> Tolerance:
        """For an engine compared with itself (two runs, batch compositions, a cache hit against its
        miss, one mode against another): both sides read the same quantised activations, so the
        dtype's row, its per-step decode widened only for quantiser boundary crossings
        (judge/tolerances.py ``SAME_ENGINE``). Equal to ``tolerance`` where nothing is declared."""
        return same_engine_tolerance_for(self.dtype, self.scale, self.activations)

    @property
    def free_running_tolerance(self) -> Tolerance:
        """The dtype's tolerance with its decode and tie bounds at ``free_running_atol``: the bound
        calibrated by null runs of correct engines (PEFT among them) on strong all-linear adapters,
        for free-running decodes that a strict per-step bound (fitted to the default adapters and
        prompts) does not cover. Equal to the strict one in float32."""
        tol = self.tolerance
        return replace(tol, decode_atol=max(tol.decode_atol, tol.free_running_atol),
                       tie_margin=max(tol.tie_margin, tol.free_running_atol))

    def decode(self, token_id: int) -> str:
        return self.runner.decode_token(token_id)

    def effects(self, plan: paired.Plan, engine, label: str) -> list:
        """The paired, teacher-forced verdict (``judge.paired.run``): for each adapter label the
        engine's effect (adapter minus base, both from the engine) must match the reference's and
        be nearest the correct hypothesis among the plan's alternatives."""
        analyses = paired.run(plan, engine, self.runner, self.tolerance)
        self._judge_effects(analyses, label)
        return analyses

    def prompt_effects(self, plan: paired.Plan, engine, label: str) -> list:
        """The paired verdict on the engine's *prompt* logprobs (``judge.paired.run_prompt_logprobs``),
        pooled over every position of every row: no single position decides."""
        analyses = paired.run_prompt_logprobs(plan, engine, self.runner, self.tolerance)
        self._judge_effects(analyses, label, {"logprobs": "prompt"})
        return analyses

    def _judge_effects(self, analyses: list, label: str, extra_evidence: Optional[dict] = None) -> None:
        self._record_effects([a.as_evidence() for a in analyses])
        assert_effects_conform(analyses, label=label, extra_evidence=extra_evidence)

    def matches_reference(self, outputs: Sequence[GenerationResult], references: Sequence[GenerationResult],
                          requests: Sequence[GenerationRequest], label: str = "",
                          tolerance: Optional[Tolerance] = None, score: Optional[Scorer] = None) -> None:
        """Prompt logprobs (pooled over every request), decode logprobs (tie-aware) and ROUGE-L of every
        output against its reference. ``score(i, step, ids)``: the reference's logprobs of ``ids`` at
        decode step ``step`` of ``references[i]`` (``assert_logprobs_close``'s ``resolve``), or None."""
        assert len(outputs) == len(references) == len(requests), "one output per request"
        tol = tolerance or self.tolerance
        whats = [f"{label + ' ' if label else ''}slot {i} (adapter={req.adapter or 'base'})"
                 for i, req in enumerate(requests)]
        assert_prompt_logprobs_close(outputs, references, tol, labels=whats, decode=self.decode)
        for i, (out, ref, what) in enumerate(zip(outputs, references, whats)):
            resolve = None if score is None else (lambda step, ids, i=i: score(i, step, ids))
            agreement = assert_logprobs_close(out, ref, tol, label=what, decode=self.decode, check_prompt=False,
                                              resolve=resolve)
            if agreement.tie_at is None:
                assert_rouge_l(out.text, ref.text, tol.rouge_l_min, label=what)

    def free_running(self, outputs: Sequence[GenerationResult], references: Sequence[GenerationResult],
                     requests: Sequence[GenerationRequest], label: str = "", score: Optional[Scorer] = None) -> None:
        """A greedy decode against the reference at the gross bounds (``free_running_tolerance``)."""
        self.matches_reference(outputs, references, requests, label=label, tolerance=self.free_running_tolerance,
                               score=score)

    def adapter_visible(self, references: Sequence[GenerationResult], others: Sequence[GenerationResult],
                        label: str = "", factor: float = 2.0, tolerance: Optional[Tolerance] = None) -> None:
        """The test's own power: the references with the adapters must differ from ``others`` (the
        base model's, or what an engine with the bug under test would give) by more than ``factor`` x
        the tolerance somewhere, or an engine that drops the adapter would pass. Raises
        AssertionError naming the test's setup."""
        tol = tolerance or self.tolerance
        wide = replace(tol, prompt_rms_max=factor * tol.prompt_rms_max, free_running_atol=factor * tol.free_running_atol,
                       decode_atol=factor * tol.decode_atol, tie_margin=factor * tol.tie_margin)
        for ref, other in zip(references, others):
            try:
                assert_logprobs_close(ref, other, wide, decode=self.decode)
            except ConformanceAssertionError:
                return  # visible
        raise AssertionError(
            f"{label}: the adapters' effect on the reference is within {factor} x the {tol.dtype} tolerance "
            f"(prompt rms {tol.prompt_rms_max}, decode {tol.decode_atol}) for every request: this test could not tell "
            "an engine that ignores them from a correct one (suite defect: strengthen the adapter)")
