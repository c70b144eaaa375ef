"""A flat two-part SVG badge: ``LoRA conformance · xpu · 41/45``."""

from __future__ import annotations

from html import escape

from lora_conformance.judge.verdict import Verdict

GREEN, YELLOW, RED, GREY = "#2e7d32", "#b58900", "#c62828", "#555"


def badge_text(verdict: Verdict, device_type: str) -> tuple[str, str]:
    """A partial run's value says so: ``2/2 partial``; a certified run's counts its waived features
    apart: ``41 passed, 12 waived / 62``."""
    passed, counted = verdict.score()
    cert = verdict.summary.get("certification") or {}
    if cert.get("mode") == "certified":
        return (f"LoRA conformance · {device_type} · certified mode",
                f"{passed} passed, {cert['waived_features']} waived / {counted}")
    return f"LoRA conformance · {device_type}", f"{passed}/{counted}" + (" partial" if verdict.partial else "")


def badge_color(verdict: Verdict) -> str:
    """Red: something failed; green: certified and every counted feature passed; else yellow
    (a partial run is never green)."""
    by = verdict.summary["features_by_status"]
    if by["failed"] or by["error"]:
        return RED
    passed, counted = verdict.score()
    return GREEN if verdict.certified and counted and passed == counted else YELLOW


def _width(text: str) -> int:
    # Verdana 11px averages ~6.5px a character; good enough without font metrics.
    return int(len(text) * 6.5) + 12


def render_badge(label: str, value: str, color: str) -> str:
    lw, vw = _width(label), _width(value)
    total = lw + vw
    label_e, value_e = escape(label), escape(value)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="20" role="img" '
        f'aria-label="{label_e}: {value_e}">'
        f"<title>{label_e}: {value_e}</title>"
        f'<rect width="{lw}" height="20" fill="{GREY}"/>'
        f'<rect x="{lw}" width="{vw}" height="20" fill="{color}"/>'
        f'<g fill="#fff" text-anchor="middle" font-family="Verdana,DejaVu Sans,sans-serif" font-size="11">'
        f'<text x="{lw / 2:.1f}" y="14">{label_e}</text>'
        f'<text x="{lw + vw / 2:.1f}" y="14">{value_e}</text>'
        f"</g></svg>\n"
    )


def badge_svg(verdict: Verdict, device_type: str) -> str:
    label, value = badge_text(verdict, device_type)
    return render_badge(label, value, badge_color(verdict))
