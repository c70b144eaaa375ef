"""Pictures of the paired effect verdict: for each adapter of a test, the engine's effect against the
reference's (one point per token id and context), the fitted slope with its interval, and the
distances to each hypothesis. Inline SVG: the report stays one self-contained file."""

from __future__ import annotations

from html import escape
from typing import Any, Mapping, Sequence

SIZE, PAD = 220, 28


def scatter_svg(analysis: Mapping[str, Any]) -> str:
    """One adapter's scatter (``analysis``: an entry of the ``lora_effects`` record field)."""
    pts = [p for p in analysis.get("plotted") or [] if isinstance(p, (list, tuple)) and len(p) == 2]
    slope, se = float(analysis.get("slope", 0.0)), float(analysis.get("slope_se", 0.0))
    if not pts:
        return ""
    lim = max(max(abs(x), abs(y)) for x, y in pts) or 1.0
    span = SIZE - 2 * PAD

    def xy(x: float, y: float) -> tuple[float, float]:
        return PAD + (x + lim) / (2 * lim) * span, SIZE - PAD - (y + lim) / (2 * lim) * span

    dots = "".join(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="1.6" fill="#3465a4" fill-opacity="0.55"/>'
                   for a, b in (xy(x, y) for x, y in pts))
    (x0, y0), (x1, y1) = xy(-lim, -lim), xy(lim, lim)
    (f0, g0), (f1, g1) = xy(-lim, -slope * lim), xy(lim, slope * lim)
    label = escape(str(analysis.get("label", "")))
    nearest = escape(str(analysis.get("nearest", "")))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{SIZE}" height="{SIZE + 18}" role="img" '
            f'aria-label="effect of {label}: slope {slope:.3f}">'
            f'<rect x="{PAD}" y="{PAD}" width="{span}" height="{span}" fill="none" stroke="#ccc"/>'
            f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="#aaa" stroke-dasharray="3,3"/>'
            f'<line x1="{f0:.1f}" y1="{g0:.1f}" x2="{f1:.1f}" y2="{g1:.1f}" stroke="#cc0000"/>{dots}'
            f'<text x="{PAD}" y="14" font-size="11">{label}: slope {slope:.3f} ± {1.96 * se:.3f} (95%)</text>'
            f'<text x="{PAD}" y="{SIZE - 8}" font-size="10">reference effect →</text>'
            f'<text x="{PAD}" y="{SIZE + 12}" font-size="10">nearest: {nearest}</text></svg>')


def distances_table(analysis: Mapping[str, Any]) -> str:
    dist = analysis.get("distances") or {}
    gamma = analysis.get("gamma") or {}
    skipped = set(analysis.get("not_judged") or ())
    rows = "".join(f"<tr><td>{escape(str(h))}</td><td class=\"num\">{float(d):.4g}</td>"
                   f"<td class=\"num\">{'' if h not in gamma else f'{float(gamma[h]):+.2f}'}</td>"
                   f"<td>{'not judged' if h in skipped else ''}</td></tr>"
                   for h, d in sorted(dist.items(), key=lambda kv: float(kv[1])))
    return ("<table><tr><th>hypothesis</th><th>rms distance</th><th>gamma</th><th></th></tr>"
            f"{rows}</table>")


def effects_html(cases: Sequence[Any], records: Mapping[str, Mapping[str, Any]]) -> str:
    """A section of scatters: failed cases first, with their distance tables."""
    blocks = []
    ordered = sorted(cases, key=lambda c: c.status not in ("failed", "error"))
    for case in ordered:
        analyses = (records.get(case.nodeid) or {}).get("effects") or []
        if not analyses:
            continue
        figs = "".join(f"<figure>{scatter_svg(a)}"
                       + (f"<figcaption>{distances_table(a)}</figcaption>" if case.status in ("failed", "error")
                          else "") + "</figure>" for a in analyses if isinstance(a, Mapping))
        blocks.append(f'<div class="effects"><h3><code>{escape(case.nodeid)}</code> ({escape(case.status)})</h3>'
                      f'<div class="figs">{figs}</div></div>')
    if not blocks:
        return ""
    return ('<h2 id="effects">Adapter effects: engine against reference</h2>'
            '<p class="muted">Each point is one token id at one teacher-forced context: x the reference\'s effect '
            "(adapter minus base, centred logprobs), y the engine's; red the fitted slope, dashed the identity.</p>"
            + "\n".join(blocks))
