"""Pictures of the paired effect verdict: for each adapter of a test, the engine's effect against the
reference's (one point per token id and context), the fitted slope with its interval, and the
distances to each hypothesis. Inline SVG: the report stays one self-contained file.

An effect is the change an adapter makes to a token's log-probability (adapter minus base, each
centred at its context), in nats; both axes share that unit and scale, so the identity line is
the diagonal. A base row has no adapter effect to fit (its reference effect is zero, its slope
undefined): its picture says so instead of showing a slope.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Mapping, Sequence

SIZE, PAD, LEFT = 240, 24, 44  # square plot area of SIZE - LEFT - PAD pixels


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def slope_text(analysis: Mapping[str, Any]) -> str:
    """``slope 0.910 ± 0.008 (95%)``, or why there is no slope (never "± inf")."""
    slope, se = _number(analysis.get("slope", 0.0)), _number(analysis.get("slope_se", 0.0))
    effect = _number(analysis.get("effect_rms"))
    if not math.isfinite(se) or not math.isfinite(slope):
        if str(analysis.get("label", "")).lower() in ("base", "none", "") or effect == 0.0:
            return "no adapter effect expected (base row): no slope"
        return "slope undefined: the reference effect has no spread"
    return f"slope {slope:.3f} ± {1.96 * se:.3f} (95%)"


def _tick(v: float) -> str:
    return f"{v:.2g}"


def scatter_svg(analysis: Mapping[str, Any]) -> str:
    """One adapter's scatter (``analysis``: an entry of the ``lora_effects`` record field)."""
    pts = [(x, y) for x, y in (
        (_number(p[0]), _number(p[1])) for p in analysis.get("plotted") or []
        if isinstance(p, (list, tuple)) and len(p) == 2) if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        return ""
    slope = _number(analysis.get("slope", 0.0))
    lim = max(max(abs(x), abs(y)) for x, y in pts) or 1.0
    x_lo, x_hi, y_lo, y_hi = LEFT, SIZE - PAD, SIZE - LEFT, PAD
    span = x_hi - x_lo

    def xy(x: float, y: float) -> tuple[float, float]:
        return x_lo + (x + lim) / (2 * lim) * span, y_lo - (y + lim) / (2 * lim) * span

    dots = "".join(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="1.6" fill="#3465a4" fill-opacity="0.55"/>'
                   for a, b in (xy(x, y) for x, y in pts))
    (i0, j0), (i1, j1) = xy(-lim, -lim), xy(lim, lim)
    fit = ""
    if math.isfinite(slope) and math.isfinite(_number(analysis.get("slope_se", 0.0))):
        s = max(-4.0, min(4.0, slope))
        (f0, g0), (f1, g1) = xy(-lim / max(1.0, abs(s)), -s * lim / max(1.0, abs(s))), \
            xy(lim / max(1.0, abs(s)), s * lim / max(1.0, abs(s)))
        fit = f'<line x1="{f0:.1f}" y1="{g0:.1f}" x2="{f1:.1f}" y2="{g1:.1f}" stroke="#cc0000"/>'
    ticks = []
    for v in (-lim, 0.0, lim):
        tx, _ = xy(v, 0)
        _, ty = xy(0, v)
        ticks.append(f'<line x1="{tx:.1f}" y1="{y_lo}" x2="{tx:.1f}" y2="{y_lo + 4}" stroke="#888"/>'
                     f'<text x="{tx:.1f}" y="{y_lo + 14}" font-size="9" text-anchor="middle">{_tick(v)}</text>'
                     f'<line x1="{x_lo - 4}" y1="{ty:.1f}" x2="{x_lo}" y2="{ty:.1f}" stroke="#888"/>'
                     f'<text x="{x_lo - 6}" y="{ty + 3:.1f}" font-size="9" text-anchor="end">{_tick(v)}</text>')
    label = escape(str(analysis.get("label", "")))
    nearest = escape(str(analysis.get("nearest", "")))
    words = escape(slope_text(analysis))
    mid_x, mid_y = (x_lo + x_hi) / 2, (y_lo + y_hi) / 2
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{SIZE}" height="{SIZE + 14}" role="img" '
            f'aria-label="effect of adapter {label}: {words}">'
            f'<rect x="{x_lo}" y="{y_hi}" width="{span}" height="{span}" fill="none" stroke="#ccc"/>'
            f'<line x1="{i0:.1f}" y1="{j0:.1f}" x2="{i1:.1f}" y2="{j1:.1f}" stroke="#aaa" stroke-dasharray="3,3"/>'
            f'{fit}{dots}{"".join(ticks)}'
            f'<text x="{x_lo}" y="12" font-size="11">adapter {label}: {words}</text>'
            f'<text x="{mid_x:.1f}" y="{SIZE - 12}" font-size="10" text-anchor="middle">'
            "reference effect (nats)</text>"
            f'<text x="10" y="{mid_y:.1f}" font-size="10" text-anchor="middle" '
            f'transform="rotate(-90 10 {mid_y:.1f})">engine effect (nats)</text>'
            f'<text x="{x_lo}" y="{SIZE + 10}" font-size="10">nearest hypothesis: {nearest}</text></svg>')


def _cell(value: Any, fmt: str) -> str:
    v = _number(value)
    return format(v, fmt) if math.isfinite(v) else "—"


def distances_table(analysis: Mapping[str, Any]) -> str:
    dist = analysis.get("distances") if isinstance(analysis.get("distances"), Mapping) else {}
    gamma = analysis.get("gamma") if isinstance(analysis.get("gamma"), Mapping) else {}
    skipped = {str(h) for h in analysis.get("not_judged") or () if isinstance(h, str)}
    order = sorted(dist.items(), key=lambda kv: (not math.isfinite(_number(kv[1])), _number(kv[1])))
    rows = "".join(f"<tr><td>{escape(str(h))}</td><td class=\"num\">{_cell(d, '.4g')}</td>"
                   f"<td class=\"num\">{'' if h not in gamma else _cell(gamma[h], '+.2f')}</td>"
                   f"<td>{'not judged' if h in skipped else ''}</td></tr>"
                   for h, d in order)
    return ("<table><tr><th>hypothesis</th><th>rms distance (nats)</th><th>gamma</th><th></th></tr>"
            f"{rows}</table>")


EXPLANATION = ('<p class="muted">Each point is one token id at one teacher-forced context: x the reference\'s '
               "effect, y the engine's (adapter minus base, centred log-probabilities, in nats); red the fitted "
               "slope, dashed the identity (a correct engine's points lie on it).</p>")


def figures(analyses: Sequence[Any], with_distances: bool) -> str:
    """The scatters of one case (with their distance tables for a failure)."""
    figs = "".join(f"<figure>{scatter_svg(a)}"
                   + (f"<figcaption>{distances_table(a)}</figcaption>" if with_distances else "") + "</figure>"
                   for a in analyses if isinstance(a, Mapping) and scatter_svg(a))
    return f'<div class="figs">{figs}</div>' if figs else ""


def effects_html(cases: Sequence[Any], records: Mapping[str, Any]) -> str:
    """The passing cases' scatters (a failure's sit in its own section of the report)."""
    blocks = []
    for case in cases:
        if case.status in ("failed", "error", "xfail"):
            continue
        rec = records.get(case.nodeid)
        figs = figures(getattr(rec, "effects", None) or [], with_distances=False)
        if figs:
            blocks.append(f'<div class="effects"><h3><code>{escape(case.nodeid)}</code> ({escape(case.status)})'
                          f"</h3>{figs}</div>")
    if not blocks:
        return ""
    return ('<h2 id="effects">Adapter effects of the other tests: engine against reference</h2>'
            + EXPLANATION + "\n".join(blocks))
