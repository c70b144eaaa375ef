"""The report's pictures of the paired effect verdict and its notes."""

from lora_conformance.report.document import build_report, check_records
from lora_conformance.report.effects_svg import distances_table, scatter_svg
from lora_conformance.report.html import render_html
from lora_conformance.report.markdown import render_markdown
from lora_conformance.judge.verdict import verify

ANALYSIS = {"label": "A", "slope": 0.91, "slope_se": 0.004, "nearest": "delta x0.9",
            "distances": {"correct": 0.2, "delta x0.9": 0.01, "q_proj LoRA dropped": 0.3},
            "gamma": {"delta x0.9": 0.95, "q_proj LoRA dropped": 0.1}, "not_judged": ["q_proj LoRA dropped"],
            "plotted": [[0.5, 0.45], [-1.0, -0.9], [2.0, 1.8]]}


def _record(nodeid, call, **extra):
    return {"nodeid": nodeid, "phases": {"setup": "passed", "call": call, "teardown": "passed"}, "wasxfail": None,
            "skip_reason": None, "message": "closest to: delta x0.9" if call == "failed" else None, "evidence": None,
            "longrepr": None, "duration": 0.1, **extra}


def test_scatter_has_a_point_per_pair_and_the_slope():
    svg = scatter_svg(ANALYSIS)
    assert svg.startswith("<svg") and svg.count("<circle") == 3
    assert "slope 0.910 ± 0.008" in svg and "nearest hypothesis: delta x0.9" in svg
    assert "reference effect (nats)" in svg and "engine effect (nats)" in svg, "axes with labels and units"
    assert scatter_svg({**ANALYSIS, "plotted": []}) == ""


def test_a_failure_s_plot_sits_inside_its_root_cause_and_notes_are_shown():
    records = [_record("suites/test_accuracy.py::test_single_adapter_matches_reference[cpu-float32-A]", "passed",
                       effects=[{**ANALYSIS, "label": "passing"}]),
               _record("suites/test_accuracy.py::test_single_adapter_matches_reference[cpu-float32-B]", "failed",
                       effects=[ANALYSIS]),
               _record("suites/test_prefix_cache.py::test_hit_equals_miss[cpu-float32]", "passed",
                       notes=["prefix-cache hit not proven (the engine does not report cached tokens)"])]
    check_records(records, "test")
    report = build_report({}, records)
    verdict = verify(report["records"])
    html = render_html(report, verdict)
    causes = html[html.index('id="root-causes"'):html.index('id="matrix"')]
    failure = causes[causes.index("cpu-float32-B"):]
    assert "<svg" in failure and "<td>not judged</td>" in failure and "rms distance" in failure, \
        "the failing case's plot and distances sit inside its root cause"
    assert "cpu-float32-A" not in causes
    others = html[html.index('id="effects"'):]
    assert "cpu-float32-A" in others and "cpu-float32-B" not in others, "passing cases' plots come after"
    assert "prefix-cache hit not proven" in html
    assert "prefix-cache hit not proven" in render_markdown(report, verdict)


def test_a_base_row_shows_no_infinite_interval():
    base = {**ANALYSIS, "label": "base", "slope": 0.0, "slope_se": float("inf"), "effect_rms": 0.0,
            "distances": {"correct": 0.0, "delta x0.9": float("inf")}}
    svg = scatter_svg(base)
    assert "inf" not in svg and "no adapter effect expected" in svg
    assert "inf" not in distances_table(base)


def test_a_base_row_summary_has_no_infinite_interval():
    from lora_conformance.judge.effects import EffectAnalysis

    base = EffectAnalysis("base", points=440, contexts=22, effect_rms=0.0, residual_rms=0.0, residual_max=0.0,
                          slope=0.0, slope_se=float("inf"), fits=[])
    assert "inf" not in base.summary() and "no adapter effect expected" in base.summary()
    adapter = EffectAnalysis("A", 10, 2, 1.0, 0.01, 0.02, 0.99, 0.004, [])
    assert "slope 0.990 ± 0.004" in adapter.summary()
