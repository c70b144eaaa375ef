"""Paired effect statistics: is the engine's adapter effect the reference's, and if not, which bug is it?

Inputs, per adapter of a test, pooled over many teacher-forced contexts (``judge/paired.py``):
at every context, the logprobs of the token ids both the engine and the reference report,
*centred* (minus their mean at that context, so a softmax normaliser cancels), for

- ``E``: the engine with the adapter minus the engine without it (same contexts, same engine:
  the engine's own rounding of the base model cancels);
- ``R``: the same difference from the reference (HF + PEFT);
- ``H[h]``: the reference under each alternative hypothesis ``h`` (``lora_conformance.judge.hypotheses``).

Statistics (contexts are the clusters: ids of one context share its noise):

- residual rms of ``E - R`` against the dtype's calibrated noise bound;
- the effective scale: slope of ``E`` on ``R`` through the origin, with a cluster-robust
  standard error;
- for each alternative ``h``: ``gamma_h``, the fraction of the way from the correct effect to
  ``h``'s (projection of ``E - R`` on ``H_h - R``). A correct engine sits near 0, an engine with
  bug ``h`` near 1; the verdict asks ``gamma_h < 0.5`` (nearer the correct hypothesis);
- the test's own power: each alternative's separation ``||H_h - R|| / noise`` (how many noise
  standard errors apart the two hypotheses are at this dtype). Below ``MIN_SEPARATION`` the test
  cannot tell the two apart: for a hypothesis the test certifies (``required``) that is a suite
  defect; any other such hypothesis is reported as "not judged" and never decides the verdict
  (judging it would turn noise into false alarms).

Robustness: the worst ``TRIM`` of contexts (by residual) are set aside before any statistic, so
one near-tie that flips in bfloat16 (an MoE router choosing another expert) does not decide a
verdict; a real bug moves every context and is not hidden by that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lora_conformance.judge.errors import ConformanceAssertionError
from lora_conformance.judge.tolerances import Tolerance

# gamma = 0.5 is the midpoint; 10 noise units of separation put it 5 standard errors from
# either hypothesis (false alarm and miss below 3e-7 each under Gaussian noise).
MIN_SEPARATION = 10.0
GAMMA_MAX = 0.5
SLOPE_Z = 4.0
MIN_POINTS = 40
MAX_PLOTTED = 150
TRIM = 0.05  # fraction of contexts set aside as outliers (only with >= 20 contexts)


class SuiteDefectError(AssertionError):
    """The test cannot separate the correct hypothesis from an alternative at this dtype."""


@dataclass
class EffectSample:
    """Centred values of one adapter's points; ``cluster[i]`` is point i's context."""

    label: str
    E: list[float] = field(default_factory=list)
    R: list[float] = field(default_factory=list)
    H: dict[str, list[float]] = field(default_factory=dict)
    cluster: list[int] = field(default_factory=list)
    contexts: int = 0
    contexts_skipped: int = 0  # contexts with fewer than three ids in common
    contexts_unpaired: int = 0  # contexts whose base run lacked the ids: effect taken against the reference base
    required: Optional[set] = None  # hypotheses the test certifies (None: all)


@dataclass
class HypothesisFit:
    name: str
    gamma: float
    se: float
    distance: float  # rms(E - H_h)
    separation: float  # ||H_h - R|| / per-point noise
    judged: bool = True  # False: not separable at this dtype and not certified by the test


@dataclass
class EffectAnalysis:
    label: str
    points: int
    contexts: int
    effect_rms: float  # rms(R): the size of what is measured
    residual_rms: float  # rms(E - R)
    residual_max: float
    slope: float
    slope_se: float
    fits: list[HypothesisFit]
    failures: list[str] = field(default_factory=list)
    defects: list[str] = field(default_factory=list)
    trimmed: int = 0
    unpaired: int = 0
    plotted: list = field(default_factory=list)  # (R, E) pairs, at most MAX_PLOTTED, for the report's picture

    @property
    def correct_distance(self) -> float:
        """rms(E - R): the distance to the correct hypothesis is the residual."""
        return self.residual_rms

    @property
    def nearest(self) -> str:
        best = min((f for f in self.fits if f.judged), key=lambda f: f.distance, default=None)
        return "correct" if best is None or self.correct_distance <= best.distance else best.name

    def summary(self) -> str:
        ranked = sorted(self.fits, key=lambda f: f.distance)[:3]
        alts = ", ".join(f"{f.name} {f.distance:.3g} (gamma {f.gamma:+.2f})" for f in ranked)
        # A base row's reference effect is zero: no slope to fit (its standard error is infinite).
        slope = (f"slope {self.slope:.3f} ± {self.slope_se:.3f}" if math.isfinite(self.slope_se)
                 else "no adapter effect expected (no slope)")
        return (f"{self.label}: {slope}, residual rms {self.residual_rms:.3g} "
                f"(effect rms {self.effect_rms:.3g}, {self.points} points / {self.contexts} contexts); distance to "
                f"correct {self.correct_distance:.3g}; nearest alternatives: {alts}")

    def as_evidence(self) -> dict:
        return {"label": self.label, "points": self.points, "contexts": self.contexts, "slope": self.slope,
                "slope_se": self.slope_se, "effect_rms": self.effect_rms, "residual_rms": self.residual_rms,
                "residual_max": self.residual_max, "nearest": self.nearest,
                "distances": {"correct": self.correct_distance, **{f.name: f.distance for f in self.fits}},
                "gamma": {f.name: f.gamma for f in self.fits},
                "gamma_se": {f.name: f.se for f in self.fits},
                "separation": {f.name: f.separation for f in self.fits},
                "not_judged": [f.name for f in self.fits if not f.judged], "trimmed_contexts": self.trimmed,
                "unpaired_contexts": self.unpaired, "plotted": self.plotted}


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


def _rms(a: Sequence[float]) -> float:
    return math.sqrt(_dot(a, a) / len(a)) if a else 0.0


def projection(y: Sequence[float], d: Sequence[float], cluster: Sequence[int]) -> tuple[float, float]:
    """Least-squares coefficient of ``y`` on ``d`` through the origin, and its cluster-robust SE."""
    dd = _dot(d, d)
    if dd == 0.0:
        return 0.0, math.inf
    coef = _dot(y, d) / dd
    scores: dict[int, float] = {}
    for yi, di, c in zip(y, d, cluster):
        scores[c] = scores.get(c, 0.0) + di * (yi - coef * di)
    n_c = len(scores)
    small = n_c / (n_c - 1) if n_c > 1 else 1.0  # finite-cluster correction
    return coef, math.sqrt(small * math.fsum(s * s for s in scores.values())) / dd


def _trimmed(sample: EffectSample) -> tuple[EffectSample, int]:
    if sample.contexts < 20:
        return sample, 0
    per: dict[int, float] = {}
    for e, r, c in zip(sample.E, sample.R, sample.cluster):
        per[c] = per.get(c, 0.0) + (e - r) ** 2
    drop = set(sorted(per, key=per.get, reverse=True)[:math.ceil(TRIM * sample.contexts)])
    keep = [i for i, c in enumerate(sample.cluster) if c not in drop]
    out = EffectSample(sample.label, [sample.E[i] for i in keep], [sample.R[i] for i in keep],
                       {k: [v[i] for i in keep] for k, v in sample.H.items()}, [sample.cluster[i] for i in keep],
                       sample.contexts - len(drop), sample.contexts_skipped, sample.contexts_unpaired, sample.required)
    return out, len(drop)


def analyse(sample: EffectSample, tol: Tolerance) -> EffectAnalysis:
    sample, trimmed = _trimmed(sample)
    E, R, cl = sample.E, sample.R, sample.cluster
    resid = [e - r for e, r in zip(E, R)]
    slope, slope_se = projection(E, R, cl)
    fits = []
    noise = tol.effect_noise
    for name, H in sample.H.items():
        D = [h - r for h, r in zip(H, R)]
        gamma, se = projection(resid, D, cl)
        fits.append(HypothesisFit(name, gamma, se, _rms([e - h for e, h in zip(E, H)]),
                                  math.sqrt(_dot(D, D)) / noise if noise > 0 else math.inf))
    a = EffectAnalysis(sample.label, len(E), sample.contexts, _rms(R), _rms(resid),
                       max((abs(x) for x in resid), default=0.0), slope, slope_se, fits,
                       trimmed=trimmed, unpaired=sample.contexts_unpaired,
                       plotted=[[round(R[i], 4), round(E[i], 4)] for i in range(0, len(E), max(1, len(E) // MAX_PLOTTED))])
    _judge(a, tol, sample.required)
    return a


def _judge(a: EffectAnalysis, tol: Tolerance, required: Optional[set] = None) -> None:
    if a.points < MIN_POINTS:
        a.failures.append(f"only {a.points} comparable points (< {MIN_POINTS}): the engine's top-k ids and the "
                          "reference's barely overlap")
        return
    # Separable at this dtype's calibrated noise (a property of the test: else a suite defect when
    # the test certifies the hypothesis), and with this run's own noise (gamma's standard error puts
    # 0.5 at least MIN_SEPARATION / 2 standard errors away). A hypothesis failing either is not judged.
    noisy: list[HypothesisFit] = []
    for f in a.fits:
        certified = required is None or f.name in required
        if f.separation < MIN_SEPARATION:
            f.judged = False
            if certified:
                a.defects.append(f"{f.name!r} is {f.separation:.1f} noise units from the correct hypothesis "
                                 f"(< {MIN_SEPARATION:g} at {tol.dtype})")
        elif f.se > GAMMA_MAX * 2 / MIN_SEPARATION:
            f.judged = False
            if certified:
                noisy.append(f)
    if a.residual_max > tol.effect_gross_atol:
        a.failures.append(f"an effect differs from the reference's by {a.residual_max:.3g} > gross bound "
                          f"{tol.effect_gross_atol:g}")
    if a.residual_rms > tol.effect_noise_max:
        a.failures.append(f"effect residual rms {a.residual_rms:.3g} > {tol.effect_noise_max:g}, the {tol.dtype} "
                          "noise bound of correct engines")
    if abs(a.slope - 1.0) > tol.effect_slope_margin + SLOPE_Z * a.slope_se:
        a.failures.append(f"effective scale {a.slope:.4f} ± {a.slope_se:.2g}: outside 1 ± "
                          f"({tol.effect_slope_margin:g} + {SLOPE_Z:g} SE)")
    for f in a.fits:
        if f.judged and f.gamma >= GAMMA_MAX:
            a.failures.append(f"closer to {f.name!r} than to correct (gamma {f.gamma:.2f} ± {f.se:.2f}; "
                              f"distance {f.distance:.3g} vs {a.correct_distance:.3g} to correct)")
    if not a.failures:  # a misfit engine inflates every other hypothesis' error: only a passing run says this
        a.defects += [f"{f.name!r} is not separable with this run's noise (gamma standard error {f.se:.2f} > "
                      f"{GAMMA_MAX * 2 / MIN_SEPARATION:g})" for f in noisy]


def assert_effects_conform(analyses: Sequence[EffectAnalysis], *, label: str = "",
                           extra_evidence: Optional[dict] = None) -> None:
    """Raise SuiteDefectError when a test lacks power, ConformanceAssertionError when the engine fails."""
    prefix = f"{label}: " if label else ""
    evidence = {"check": "effects", "label": label, "analyses": [a.as_evidence() for a in analyses],
                **(extra_evidence or {})}
    defects = [f"{a.label}: {d}" for a in analyses for d in a.defects]
    if defects:
        raise SuiteDefectError(f"{prefix}suite defect — this test cannot tell these hypotheses from the correct "
                               "one at this dtype (strengthen the adapter or add contexts):\n  " + "\n  ".join(defects))
    bad = [a for a in analyses if a.failures]
    if bad:
        worst = bad[0]
        nearest = worst.nearest
        evidence["hypothesis"] = {"nearest": nearest, "adapter": worst.label}
        lines = [f"{a.label}: " + "; ".join(a.failures) for a in bad]
        head = (f"{prefix}closest to: {nearest} (adapter {worst.label})" if nearest != "correct"
                else f"{prefix}effect does not match the reference (adapter {worst.label})")
        raise ConformanceAssertionError(head + "\n  " + "\n  ".join(lines) + "\n" +
                                        "\n".join(a.summary() for a in analyses), evidence)
