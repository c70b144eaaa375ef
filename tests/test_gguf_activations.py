"""8-bit activations in front of a GGUF base's quantised matmuls: the quantisers, the built-in and PEFT
engines that read them (engine arg activations=int8), the tolerance rows they select and what the
report says (engines/builtin/layers/gguf_base.py, judge/tolerances.py ACTIVATIONS)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lora_conformance.engines.base import UnsupportedFeatureError  # noqa: E402
from lora_conformance.engines.builtin.layers.gguf_base import quantize_dequantize  # noqa: E402
from lora_conformance.judge.tolerances import ACTIVATIONS, TOLERANCES, tolerance_for  # noqa: E402
from lora_conformance.models import quant  # noqa: E402


def rows(n=6, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.linspace(0.1, 3.0, k)
    x[0, :32] = 0.0  # a zero block: scale 0, no division by it
    return x


def test_q8_0_activations_are_ggml_q8_0_blocks():
    """The activation quantiser of Q8_0 is the Q8_0 format itself (models/quant.py's, bit-exact with
    gguf-py): quantising a row and decoding it gives what the weight quantiser gives for that row."""
    x = rows()
    want = quant.dequantize("q8_0", quant.quantize("q8_0", x.numpy()), tuple(x.shape))
    assert np.array_equal(quantize_dequantize(x, "q8_0").numpy(), want)


def test_q8_k_blocks_keep_their_extreme_and_stay_within_half_a_step():
    x = rows(seed=1)
    y = quantize_dequantize(x, "q8_k")
    b, yb = x.reshape(-1, 256), y.reshape(-1, 256)
    step = b.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((yb - b).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    i = b.abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(torch.gather(yb, 1, i), torch.gather(b, 1, i), rtol=1e-6)  # the extreme maps to -127 d
    assert not torch.equal(y, x)


def test_the_other_quantiser_differs_from_ggmls_in_both_schemes():
    x = rows(seed=2)
    for scheme in ("q8_0", "q8_k"):
        assert not torch.equal(quantize_dequantize(x, scheme), quantize_dequantize(x, scheme, other=True)), scheme


def test_a_row_that_is_not_whole_blocks_names_the_block():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        quantize_dequantize(torch.zeros(2, 96), "q8_k")


def test_rows_for_8_bit_activations_widen_and_never_tighten():
    for dtype, base in TOLERANCES.items():
        wide = tolerance_for(dtype, activations="q8_0")
        assert wide.activations == "int8"
        for field, value in ACTIVATIONS["int8"].get(dtype, {}).items():
            have, was = getattr(wide, field), getattr(base, field)
            assert (have == min(was, value)) if field == "rouge_l_min" else (have == max(was, value)), (dtype, field)
        assert tolerance_for(dtype, activations=None) == base
    assert tolerance_for("float32", activations="q8_k").decode_atol > TOLERANCES["float32"].decode_atol
    with pytest.raises(ValueError, match="activation scheme 'q4_0'"):
        tolerance_for("float32", activations="q4_0")


def test_real_shapes_widen_the_effect_rows_for_8_bit_activations_and_nothing_else():
    """At the real scale class the 8-bit activation rows widen the effect bounds (ACTIVATIONS_REAL: a
    correct engine of that arithmetic failed rank 128 at real shapes), never tighten a field, and leave
    the small bases' rows and runs without 8-bit activations as they were."""
    from dataclasses import fields

    from lora_conformance.judge.tolerances import ACTIVATIONS_REAL

    for dtype in TOLERANCES:
        small, real = tolerance_for(dtype, "small", "q8_0"), tolerance_for(dtype, "real", "q8_0")
        plain = tolerance_for(dtype, "real")
        for field, value in ACTIVATIONS_REAL["int8"][dtype].items():
            assert getattr(real, field) == max(value, getattr(plain, field), getattr(small, field)), (dtype, field)
        for f in fields(real):
            if f.name in ("scale", "dtype", "activations"):
                continue
            r, p_ = getattr(real, f.name), getattr(plain, f.name)
            assert (r <= p_) if f.name == "rouge_l_min" else (r >= p_), (dtype, f.name)
        assert tolerance_for(dtype, "real", None) == plain
    assert tolerance_for("float32", "real", "q8_0").effect_noise_max > tolerance_for("float32", "small", "q8_0").effect_noise_max


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from lora_conformance.models import resolve_base_model

    root = tmp_path_factory.mktemp("gguf-act")
    float_base = resolve_base_model("synthetic:llama", root / "models")
    return float_base, {s: quant.snapped_checkpoint(float_base, s, root / "q") for s in ("q8_0", "q4_k")}


def _first_step(engine, prompts, adapter=None):
    from lora_conformance.types import GenerationRequest

    return [o.logprobs[0] for o in engine.generate([GenerationRequest(p, adapter, 1, 5) for p in prompts])]


def _max_diff(a, b):
    return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in set(x) & set(y))


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_builtin_and_peft_read_8_bit_activations_alike_and_the_reference_does_not(bases, scheme, tmp_path):
    """Both emulations of llama.cpp's activations move the logprobs far past float32's rounding, and stay
    near each other (the same quantiser; a float32 rounding difference can flip one block's rounding).
    With float activations the built-in engine, reading the GGUF blocks, matches the reference."""
    from lora_conformance.adapters import DEFAULT_ADAPTERS, synthesize_cached
    from lora_conformance.engines import create_engine
    from lora_conformance.models import default_prompts
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    model = bases[1][scheme]
    prompts = default_prompts()[:6]
    path = synthesize_cached(model, DEFAULT_ADAPTERS["A"], tmp_path / "adapters")
    ref = [r.logprobs[0] for r in ReferenceRunner(model, "cpu", "float32").generate(
        [GenerationRequest(p, "A", 1, 5) for p in prompts], {"A": path})]
    got = {}
    for name, args in [("builtin", {}), ("builtin", {"activations": "int8"}), ("peft", {"activations": "int8"})]:
        engine = create_engine(name, model, "cpu", "float32", args)
        try:
            engine.load_adapter("A", path)
            got[(name, args.get("activations", "float"))] = _first_step(engine, prompts, "A")
        finally:
            engine.close()
    assert _max_diff(got[("builtin", "float")], ref) < 1e-4
    emulated = _max_diff(got[("builtin", "int8")], ref)
    assert emulated > 10 * TOLERANCES["float32"].decode_atol
    assert _max_diff(got[("builtin", "int8")], got[("peft", "int8")]) < emulated / 4


def test_engines_refuse_8_bit_activations_where_no_gguf_base_is(bases):
    from lora_conformance.engines import create_engine

    float_base, snapped = bases
    with pytest.raises(UnsupportedFeatureError, match=r"activations=int8 .* this base is 'none' .*q8_0 or q4_k"):
        create_engine("builtin", float_base, "cpu", "float32", {"activations": "int8"})
    with pytest.raises(UnsupportedFeatureError, match="holds a GGUF base .* only with activations=int8"):
        create_engine("peft", snapped["q8_0"], "cpu", "float32", {})
    with pytest.raises(UnsupportedFeatureError, match=r"activations=int8_alt .* this base is 'none'"):
        create_engine("builtin", float_base, "cpu", "float32", {"activations": "int8_alt"})


def test_an_encoder_runs_float_under_8_bit_activations(tmp_path):
    """--base-quant snaps decoders only, so the embeddings suites' encoder stays float: an engine started
    with activations=int8 serves it (nothing to quantise) instead of refusing the whole suite."""
    from lora_conformance.engines import create_engine
    from lora_conformance.models import resolve_base_model

    encoder = resolve_base_model("synthetic:encoder", tmp_path / "models")
    engine = create_engine("builtin", encoder, "cpu", "float32", {"activations": "int8"})
    try:
        assert len(engine.embed(["a b c"])[0]) > 0
    finally:
        engine.close()


def test_declared_activations(bases):
    from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine
    from lora_conformance.engines.peft_engine import PeftEngine

    float_base, snapped = bases
    int8 = BuiltinEngine.parse_args({"activations": "int8"})
    assert BuiltinEngine.declared_activations(int8, snapped["q8_0"], "cpu") == "q8_0"
    assert BuiltinEngine.declared_activations(int8, snapped["q4_k"], "cpu") == "q8_k"
    alt = BuiltinEngine.parse_args({"activations": "int8_alt"})
    assert BuiltinEngine.declared_activations(alt, snapped["q4_k"], "cpu") == "q8_k"
    assert BuiltinEngine.declared_activations(BuiltinEngine.parse_args({}), snapped["q8_0"], "cpu") is None
    assert PeftEngine.declared_activations(PeftEngine.parse_args({"activations": "int8"}), snapped["q4_k"], "cpu") == "q8_k"
    cfg = LlamaCppEngine.parse_args({})
    assert LlamaCppEngine.declared_activations(cfg, snapped["q8_0"], "cpu") == "q8_0"
    assert LlamaCppEngine.declared_activations(cfg, snapped["q4_k"], "cpu") == "q8_k"
    assert LlamaCppEngine.declared_activations(cfg, float_base, "cpu") is None


def test_the_report_says_which_activations_and_rows():
    from lora_conformance.report.markdown import environment_rows

    env = {"dtype": "float32", "activations": {"scheme": "q8_0", "description": quant.ACTIVATION_SCHEMES["q8_0"],
                                               "tolerance_class": "int8", "rows": ACTIVATIONS["int8"],
                                               "declared_by": "llamacpp's declared_activations"}}
    row = dict(environment_rows(env))["activations"]
    assert row.startswith("q8_0: 8-bit activation blocks of 32") and "rows for int8 activations" in row
    assert "float32" in row and "llamacpp" in row


def test_openvino_declares_its_dynamic_quantisation_only_where_the_plugin_applies_it(bases, tmp_path):
    """The CPU plugin quantises activations (symmetric groups of 32, float32 scale: bit-exact with the
    int8_alt Q8_0 quantiser, bench/openvino_dynamic_quant.py) only for compressed weights and float32
    sources; our default turns it off for a quantised base in float32."""
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    float_base = bases[0]
    ov8 = quant.snapped_checkpoint(float_base, "ov_int8", tmp_path / "q")
    on, default = OpenVINOEngine.parse_args({"dynamic_quantization": "on"}), OpenVINOEngine.parse_args({})
    assert OpenVINOEngine.declared_activations(on, ov8, "cpu", "float32") == "ov_dq32"
    assert OpenVINOEngine.declared_activations(on, ov8, "cpu", "bfloat16") is None
    assert OpenVINOEngine.declared_activations(default, ov8, "cpu", "float32") is None
    assert OpenVINOEngine.declared_activations(on, float_base, "cpu", "float32") is None
    assert tolerance_for("float32", activations="ov_dq32") == tolerance_for("float32", activations="q8_0")


def test_same_engine_comparisons_widen_only_the_per_step_decode_and_less():
    from lora_conformance.judge.tolerances import SAME_ENGINE, same_engine_tolerance_for

    for dtype, base in TOLERANCES.items():
        same = same_engine_tolerance_for(dtype, activations="q8_k")
        wide = tolerance_for(dtype, activations="q8_k")
        assert same_engine_tolerance_for(dtype) == base
        for field in ("effect_noise_max", "prompt_rms_max", "free_running_atol", "effect_gross_atol"):
            assert getattr(same, field) == getattr(base, field), (dtype, field)
        assert base.decode_atol <= same.decode_atol <= wide.decode_atol, dtype
        assert same.decode_atol == max(base.decode_atol, SAME_ENGINE["int8"].get(dtype, {}).get("decode_atol", 0))
