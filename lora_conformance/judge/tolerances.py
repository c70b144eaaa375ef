"""One tolerance table, per dtype of the engine under test. Nothing else holds a tolerance.

The reference is HF transformers + PEFT in float32 (by default). Each row was measured on
correct engines against that reference, then checked to catch every injected fault of the
built-in engine (tests/test_detection_power.py); ``bench/calibrate_tolerances.py`` prints
the measured worst cases next to these values.

Measured worst cases (all suites, default prompts, 16 new tokens):
- float32: built-in engine and PEFT on cpu, built-in on an H200: logprob drift <= 1e-4
  (the table allows 2e-3; the fault ``lora_fp16`` drifts further and is caught).
- bfloat16: built-in engine on an H200 (graphs on and off): decode 0.53 (MoE, step 15),
  prefill 0.26; on cpu below 0.25. Drift grows with the step: bf16 rounding compounds.
- float16: decode within 0.046 (built-in and PEFT on cpu; the H200 runs stayed inside 0.08);
  prefill up to 0.116 (PEFT on cpu, 0.089 built-in).
`python bench/calibrate_tolerances.py` on cpu, worst over base + 4 default adapters x
16 prompts: float32 prefill 5.0e-5 / decode 1.1e-4; bfloat16 0.26 / 0.31; float16 0.116 / 0.046.
Prompt logprobs have no per-position bound: a correct bfloat16 engine with refactored LoRA factors
moved one position by 0.47. They are judged pooled (``prompt_rms_max``, single points only against
the gross ``free_running_atol``), and precisely by the paired prompt-logprob verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerance:
    dtype: str
    # Prompt logprobs against the reference (judge/logprobs.py): bound on the rms, pooled over a
    # prompt's positions, of the centred differences on the ids both sides report (a gross check
    # beside the paired verdict of paired.run_prompt_logprobs; single points: effect_gross_atol).
    prompt_rms_max: float
    # max |logprob(actual) - logprob(reference)| over the top-k ids both sides report, per decode step
    decode_atol: float
    # A divergence is a tie (not a failure) only where the reference's logprob gap between
    # its own token and the engine's token is below this: the dtype's noise floor.
    tie_margin: float
    # ROUGE-L F1 floor for decoded text against the reference.
    rouge_l_min: float
    # Embeddings: cosine to the reference.
    embedding_cos_min: float
    # Paired effect statistics (judge/effects.py), on centred next-token logprobs at
    # teacher-forced contexts: typical per-point noise of a correct engine's effect (used for
    # the tests' own power), the bound on its residual rms, the slope margin, the gross bound.
    effect_noise: float = 0.0
    effect_noise_max: float = 0.0
    effect_slope_margin: float = 0.0
    effect_gross_atol: float = 0.0
    # Embeddings: bound on the pooled relative residual of the adapter-induced change.
    embedding_effect_rel_max: float = 0.0
    # The free-running decode check beside the effect verdict (decode and tie bound): a gross check
    # of the decode path; the effect statistics are the precise one.
    free_running_atol: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


# The effect verdict's bounds (judge/effects.py), calibrated by bench/power.py: null runs of
# correct engines with benign variations (default, rescale:3, rescale:0.25, preround, reverse,
# one_at_a_time, PEFT), 200 randomised runs per dtype on the H200 (cuda) and 200 on its host's cpu,
# families accuracy / semantics / all-linear (q/k B 5x) / mixed. Worst seen, as a
# fraction of the bounds then in force, and the bound set from it (about 1.5x the worst):
#   bfloat16: residual rms 0.101 (cuda) / 0.100 (cpu) -> effect_noise_max 0.15; gross 1.09 -> 2.0;
#             free-running decode 1.71 -> 2.5; |slope - 1| at most 0.14 of (margin + 4 SE).
#   float16:  residual rms 0.0094 -> 0.015; free-running 0.284 -> 0.45.
#   float32:  residual rms 2.9e-5 -> 1e-3; free-running 1.4e-4 (of 2e-3).
# All runs over the earlier guesses (bf16 0.06 / 1.0 / 1.5, fp16 free-running 0.2: 21 and 17 bf16,
# 12 and 11 fp16 runs of 200) were in the strong all-linear family; none at these bounds. The same
# runs' power (8 per cell): every single module dropped, and x1.05 / x1.1 mis-scales, caught in every
# bf16 run; fp16 and f32 catch 3%. effect_noise is the per-point noise the tests' own power assumes.
EFFECTS: dict[str, dict[str, float]] = {
    "float32": dict(effect_noise=1e-4, effect_noise_max=1e-3, effect_slope_margin=0.005, effect_gross_atol=1e-2,
                    embedding_effect_rel_max=1e-3, free_running_atol=2e-3),
    "bfloat16": dict(effect_noise=0.02, effect_noise_max=0.15, effect_slope_margin=0.03, effect_gross_atol=2.0,
                     embedding_effect_rel_max=0.15, free_running_atol=2.5),
    "float16": dict(effect_noise=0.005, effect_noise_max=0.015, effect_slope_margin=0.01, effect_gross_atol=0.3,
                    embedding_effect_rel_max=0.03, free_running_atol=0.8),
}

# Prompt logprobs and the free-running gross bounds, from bench/power.py's null runs with the benign
# rewritings (rescale, scaling folded into A or B, SVD re-factorisation, rank permuted or padded with
# zeros, pre-rounding, LoRA merged into the base weights, reversed / one-at-a-time batches, PEFT),
# 200 runs per dtype on the H200 host's cpu, families accuracy / semantics / all-linear / mixed / MoE
# (reports/2026-12-02-null-runs-rewritings-moe-power.md). Worst seen:
#   prompt rms of one request (centred, pooled over its positions): bfloat16 0.224 (an all-linear adapter
#     on a prompt of 3 positions; 0.145 in every other request), float16 0.033, float32 3.2e-5. The check
#     pools every request of a comparison (compare.assert_prompt_logprobs_close), which stays below its
#     worst request: prompt_rms_max bfloat16 0.3, float16 0.05, float32 1e-3.
#   free-running decode, float16: 0.538 at step 0 on the MoE family (the default engine; 0.28 elsewhere)
#     and a single prompt point 0.42 -> free_running_atol 0.8 (it also bounds single prompt points).
# The paired checks (teacher-forced contexts and prompt logprobs) had 0 false alarms in 200 runs per
# dtype at the bounds above (EFFECTS), the prompt check's worst residual 0.43 of its bound (float16).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance("float32", prompt_rms_max=1e-3, decode_atol=2e-3, tie_margin=2e-3,
                         rouge_l_min=1.0, embedding_cos_min=0.999, **EFFECTS["float32"]),
    "bfloat16": Tolerance("bfloat16", prompt_rms_max=0.3, decode_atol=0.75, tie_margin=0.75,
                          rouge_l_min=0.9, embedding_cos_min=0.99, **EFFECTS["bfloat16"]),
    "float16": Tolerance("float16", prompt_rms_max=0.05, decode_atol=0.08, tie_margin=0.08,
                         rouge_l_min=0.9, embedding_cos_min=0.995, **EFFECTS["float16"]),
}


def tolerance_for(dtype: str) -> Tolerance:
    try:
        return TOLERANCES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}") from None
