"""models/quant.py: each scheme's round trip, gguf's own dequantize agreeing with ours, the snapped
checkpoint (the reference's dequantised weights equal what the stored form dequantises to), and
engines refusing the schemes they do not hold."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lora_conformance.models import BASE_QUANT_SCHEMES, quant

SCHEMES = [s for s in quant.SCHEMES if s != "none"]
# the largest error of one weight, relative to the largest |w| of its block / channel / group
STEP = {"int8": 2 / 127, "q8_0": 2 / 127, "ov_int8": 1 / 255, "ov_int4": 1 / 15}  # of the span


def weights(rows=48, cols=512, seed=0, std=0.05):
    g = np.random.default_rng(seed)
    w = (g.standard_normal((rows, cols)) * std).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scales of zero must not divide
    w[5, :40] *= 30  # outliers in one block
    return w


def test_option_choices_are_the_schemes():
    from lora_conformance.options import BY_NAME

    assert tuple(quant.SCHEMES) == BASE_QUANT_SCHEMES
    option = BY_NAME["base_quant"]
    assert option.choices == BASE_QUANT_SCHEMES and option.default == "none"
    assert option.flag == "--base-quant" and option.env == "LORA_CONFORMANCE_BASE_QUANT"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_error_is_within_one_step(scheme):
    w = weights()
    t, wd = quant.snap(scheme, w)
    assert wd.shape == w.shape and wd.dtype == np.float32
    assert np.all(wd[3] == 0), "an all-zero row dequantises to zeros"
    if scheme == "q4_k":  # half its sub-block's decoded step, plus half dmin (the min's 6-bit rounding)
        b = t["blocks"].reshape(-1, quant.Q4_K_BYTES)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, _ = quant._unpack_scales(b[:, 4:16])
        bound = (d * sc + dmin) / 2  # (blocks, 8)
        err = np.abs(wd - w).reshape(-1, 8, 32).max(axis=2)
        assert np.all(err <= bound * (1 + 1e-3) + 1e-7), f"q4_k: worst error {err.max()}"
        return
    block = {"q8_0": 32, "q4_k": 32, "ov_int4": 128}.get(scheme, w.shape[1])
    err = np.abs(wd - w).reshape(w.shape[0], -1, block)
    span = (w.reshape(err.shape).max(axis=2, keepdims=True) - np.minimum(w.reshape(err.shape).min(axis=2, keepdims=True), 0))
    bound = span * STEP[scheme] / 2 * (1 + 2e-3)  # half a step (scales stored in float16: a little more)
    assert np.all(err <= bound + 1e-7), f"{scheme}: worst error {err.max()} over its step"
    assert np.abs(wd - w).max() > 0, "quantisation that changes nothing is not quantisation"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantising_the_stored_form_is_deterministic_and_typed(scheme):
    w = weights(seed=1)
    t = quant.quantize(scheme, w)
    kinds = {k: v.dtype for k, v in t.items()}
    expected = {"int8": {"qweight": np.int8, "scale": np.float32}, "q8_0": {"blocks": np.uint8},
                "q4_k": {"blocks": np.uint8},
                "ov_int8": {"qweight": np.uint8, "zero_point": np.uint8, "scale": np.float16},
                "ov_int4": {"qweight": np.uint8, "zero_point": np.uint8, "scale": np.float16}}[scheme]
    assert kinds == expected
    if scheme == "ov_int4":
        assert t["qweight"].max() <= 15 and t["zero_point"].max() <= 15
    assert np.array_equal(quant.dequantize(scheme, t, w.shape), quant.dequantize(scheme, t, w.shape))


def test_q8_0_is_bit_exact_with_gguf_and_gguf_dequantizes_it_as_we_do():
    gguf = pytest.importorskip("gguf")
    w = weights(seed=2)
    ours = quant.quantize("q8_0", w)["blocks"]
    theirs = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(quant.dequantize("q8_0", {"blocks": ours}, w.shape),
                          gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q8_0))


def test_q4_k_blocks_dequantize_in_gguf_as_in_ours():
    gguf = pytest.importorskip("gguf")
    w = weights(rows=16, cols=1024, seed=3)
    blocks = quant.quantize("q4_k", w)["blocks"]
    assert blocks.shape == (16, 1024 // 256 * 144)
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(quant.dequantize("q4_k", {"blocks": blocks}, w.shape), theirs)


def test_q4_k_scale_packing_round_trips_every_6_bit_value():
    sc = np.arange(64, dtype=np.uint8)[:64].reshape(8, 8)
    mn = (63 - np.arange(64, dtype=np.uint8)).reshape(8, 8)
    got_sc, got_mn = quant._unpack_scales(quant._pack_scales(sc, mn))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_mn, mn)


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k", "ov_int4"])
def test_a_row_that_is_not_whole_blocks_is_refused(scheme):
    with pytest.raises(quant.QuantError, match="not a multiple"):
        quant.quantize(scheme, np.zeros((2, 100), dtype=np.float32))


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="q8_0"):
        quant.check_scheme("q3")


def test_quantizable_tensors_are_the_decoder_layers_linear_weights():
    assert quant.quantizable("model.layers.0.self_attn.q_proj.weight", (256, 256))
    assert quant.quantizable("model.layers.3.mlp.down_proj.weight", (256, 512))
    assert not quant.quantizable("model.layers.0.self_attn.q_proj.bias", (256,))
    assert not quant.quantizable("model.embed_tokens.weight", (1028, 256))
    assert not quant.quantizable("lm_head.weight", (1028, 256))
    assert not quant.quantizable("model.layers.0.mlp.experts.gate_up_proj", (4, 512, 256))


@pytest.fixture(scope="module")
def float_base(tmp_path_factory):
    from lora_conformance.models import resolve_base_model

    return resolve_base_model("synthetic:llama", tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_snapped_checkpoint_holds_what_its_stored_form_dequantizes_to(float_base, tmp_path, scheme):
    from safetensors.numpy import load_file

    snapped = quant.snapped_checkpoint(float_base, scheme, tmp_path)
    assert quant.snapped_checkpoint(float_base, scheme, tmp_path) == snapped  # built once
    manifest = json.loads((snapped / quant.MANIFEST).read_text())
    assert manifest["scheme"] == scheme and "dequantised" in manifest["reference"]
    original = load_file(str(float_base / "model.safetensors"))
    floats = load_file(str(snapped / "model.safetensors"))
    stored = quant.load_quantized(snapped)
    assert set(stored) == set(manifest["tensors"]) and len(stored) == 4 * 7  # 4 layers x q k v o gate up down
    for name, t in stored.items():
        assert np.array_equal(quant.dequantize(scheme, t, floats[name].shape), floats[name]), name
        # layer 0's hand-set q/k (constant rows along one direction) can sit on the grid exactly
        if not name.startswith("model.layers.0.self_attn."):
            assert not np.array_equal(floats[name], original[name]), f"{name} was not quantised"
    for name in manifest["kept_float"]:
        assert np.array_equal(floats[name], original[name]), f"{name} should stay float"
    assert quant.scheme_of(snapped) == scheme and quant.scheme_of(float_base) == "none"
    assert quant.describe(snapped)["quantized_tensors"] == 28


def test_the_snapped_checkpoint_loads_in_transformers(float_base, tmp_path):
    import torch

    from lora_conformance.models import load_model

    snapped = quant.snapped_checkpoint(float_base, "int8", tmp_path)
    model = load_model(snapped)
    want = quant.dequantize("int8", quant.load_quantized(snapped)["model.layers.1.mlp.up_proj.weight"], (512, 256))
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, torch.from_numpy(want))


def test_reference_keys_name_the_scheme(float_base, tmp_path):
    from lora_conformance.reference import ReferenceCache, ReferenceRunner
    from lora_conformance.types import GenerationRequest

    req = GenerationRequest(prompt="a b", max_new_tokens=1)
    plain = ReferenceRunner(float_base, cache=ReferenceCache(tmp_path / "r"))
    snapped = ReferenceRunner(quant.snapped_checkpoint(float_base, "q8_0", tmp_path), cache=ReferenceCache(tmp_path / "r"))
    assert plain.base_quant == {} and snapped.base_quant == {"base_quant": ["q8_0", quant.QUANT_VERSION]}
    assert plain._cache_key(req, None, "generate") != snapped._cache_key(req, None, "generate")


def test_a_malformed_manifest_names_the_file(tmp_path):
    (tmp_path / quant.MANIFEST).write_text('{"scheme": "q9"}')
    with pytest.raises(ValueError, match=str(tmp_path / quant.MANIFEST)):
        quant.scheme_of(tmp_path)


def test_engines_refuse_schemes_they_do_not_hold(float_base, tmp_path):
    from lora_conformance.engines.base import UnsupportedFeatureError
    from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine
    from lora_conformance.engines.peft_engine import PeftEngine

    ov4 = quant.snapped_checkpoint(float_base, "ov_int4", tmp_path)
    with pytest.raises(UnsupportedFeatureError, match=r"cannot hold a ov_int4 quantised base.*int8: its own"):
        BuiltinEngine.check_base_quant(ov4)
    with pytest.raises(UnsupportedFeatureError, match=r"q8_0: with activations=int8 only"):
        PeftEngine.check_base_quant(ov4)
    assert BuiltinEngine.check_base_quant(quant.snapped_checkpoint(float_base, "int8", tmp_path)) == "int8"
    assert PeftEngine.check_base_quant(float_base) == "none"


def test_the_report_names_the_scheme_and_how_the_reference_was_made():
    from types import SimpleNamespace

    from lora_conformance.report.environment import fingerprint
    from lora_conformance.report.markdown import environment_rows, rerun_command

    settings = SimpleNamespace(device="cpu", engine="llamacpp", engine_args={}, dtype="bfloat16",
                               reference_device="cpu", reference_dtype="float32", base_model="synthetic:llama",
                               base_quant="q4_k")
    env = fingerprint(settings, {"device": {"device_name": "test cpu"}})
    assert env["base_quant"]["scheme"] == "q4_k" and "dequantised" in env["base_quant"]["reference"]
    rows = dict(environment_rows(env))
    assert rows["base quantisation"].startswith("q4_k: GGUF Q4_K")
    assert "HF transformers + PEFT on the dequantised base" in rows["reference made by"]
    assert "--base-quant=q4_k" in rerun_command(env, "suites/test_accuracy.py::x")
    plain = fingerprint(SimpleNamespace(**{**vars(settings), "base_quant": "none"}), {"device": {"device_name": "c"}})
    assert plain["base_quant"] is None and "base quantisation" not in dict(environment_rows(plain))


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_llama_cpp_loads_our_gguf_blocks_and_serves_the_dequantised_base(float_base, tmp_path, scheme):
    """The converter writes the stored blocks (gguf-py reads them back as they are); llama.cpp loads
    them and its base logprobs sit near the reference on the dequantised base (its dot products
    quantise activations to 8 bits: within 0.1, not float32's 2e-3) and far nearer than the float base's."""
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    from lora_conformance.engines import llamacpp_convert
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    snapped = quant.snapped_checkpoint(float_base, scheme, tmp_path)
    path = llamacpp_convert.convert_model(snapped, tmp_path / "gguf", "float32")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    stored = quant.load_quantized(snapped)["model.layers.1.mlp.down_proj.weight"]["blocks"]
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == scheme.upper()
    assert np.array_equal(np.asarray(tensors["blk.1.ffn_down.weight"].data).reshape(stored.shape), stored)
    eng = LlamaCppEngine(snapped, "cpu", "float32", {"extra_bufts": "0", "gguf_cache": str(tmp_path / "g")})
    try:
        reqs = [GenerationRequest(prompt=p, max_new_tokens=3, top_k=5) for p in ("the cat sat on", "a b c d")]
        got = eng.generate(reqs)
    finally:
        eng.close()
    want, floats = ReferenceRunner(snapped).generate(reqs), ReferenceRunner(float_base).generate(reqs)
    for g, w, f in zip(got, want, floats):
        assert g.token_ids == w.token_ids
        near = max(abs(g.logprobs[0][t] - w.logprobs[0][t]) for t in w.logprobs[0] if t in g.logprobs[0])
        far = max(abs(f.logprobs[0][t] - w.logprobs[0][t]) for t in w.logprobs[0] if t in f.logprobs[0])
        assert near < 0.1 and near < far, (near, far)


@pytest.mark.parametrize("scheme", ["ov_int8", "ov_int4"])
def test_openvino_ir_holds_the_stored_codes_and_computes_the_dequantised_base(float_base, tmp_path, scheme):
    """The converted IR keeps the stored u8 / u4 codes as constants (the weight-compression subgraph is
    not folded back to float), and with the plugin's dynamic quantization off its logits are the
    reference's on the dequantised base, to float32 precision."""
    ov = pytest.importorskip("openvino")
    import torch

    from lora_conformance.engines import openvino_convert
    from lora_conformance.models import load_model

    snapped = quant.snapped_checkpoint(float_base, scheme, tmp_path)
    ir = openvino_convert.converted_model(snapped, tmp_path / "ir")
    model = ov.Core().read_model(str(ir / "openvino_model.xml"))
    want = ov.Type.u8 if scheme == "ov_int8" else ov.Type.u4
    codes = [op for op in model.get_ops() if op.get_type_name() == "Constant" and op.get_output_element_type(0) == want
             and op.get_output_shape(0)[-1] > 1]  # not the zero points: (out, 1) / (out, groups, 1)
    assert len(codes) == 28  # every quantised weight's codes
    stored = quant.load_quantized(snapped)["model.layers.0.mlp.up_proj.weight"]["qweight"]

    def values(c):  # u4 constants hold two codes a byte, the first in the low nibble
        d = np.asarray(c.get_data()).reshape(-1)
        return (d if scheme == "ov_int8" else np.stack([d & 15, d >> 4], axis=1).reshape(-1)).reshape(stored.shape)

    assert any(np.array_equal(values(c), stored) for c in codes if tuple(c.get_output_shape(0))[0] == stored.shape[0]
               and np.prod(c.get_output_shape(0)) == stored.size)
    ids = np.array([[1, 40, 77, 300, 512, 900, 33, 64]], dtype=np.int64)
    with torch.no_grad():
        ref = load_model(snapped)(torch.from_numpy(ids)).logits[0].numpy()
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                      "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    out = compiled.create_infer_request().infer({"input_ids": ids, "attention_mask": np.ones_like(ids),
                                                 "position_ids": np.arange(ids.shape[1])[None],
                                                 "beam_idx": np.array([0], dtype=np.int32)})
    assert np.abs(out[compiled.output("logits")][0] - ref).max() < 5e-3
