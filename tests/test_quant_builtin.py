"""The built-in engine's int8 base (layers/int8_linear.py): it holds int8 codes, not floats, and its
outputs are the dequantised base's; the tensor-parallel path refuses it. The quantised faults'
detection is tests/test_detection_power.py's (with --base-quant int8)."""

from __future__ import annotations

import pytest
import torch

from lora_conformance.models import quant


@pytest.fixture(scope="module")
def int8_base(tmp_path_factory):
    from lora_conformance.models import resolve_base_model

    root = tmp_path_factory.mktemp("models")
    return quant.snapped_checkpoint(resolve_base_model("synthetic:llama", root), "int8", root / "quantized")


@pytest.fixture(scope="module")
def engine(int8_base):
    from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine

    eng = BuiltinEngine(int8_base, "cpu", "float32", {})
    yield eng
    eng.close()


def test_every_decoder_linear_holds_int8_codes_and_no_float_weight(engine):
    from lora_conformance.engines.builtin.layers.int8_linear import Int8Base
    from lora_conformance.engines.builtin.layers.linear import LoraLinear

    held = {n: m for n, m in engine.model.named_modules() if isinstance(m, LoraLinear) and ".layers." in n}
    assert len(held) == 4 * 7
    for name, m in held.items():
        assert isinstance(m.group.quant, Int8Base), name
        assert m.group.quant.qt.dtype == torch.int8
        assert m.weight.stride() == (0, 0) and not m.weight.any(), f"{name} keeps a float weight"
    assert engine.base_quant == "int8"
    assert engine.model.lm_head.group.quant is None  # lm_head stays float


def test_outputs_are_the_dequantised_base(engine, int8_base):
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    reqs = [GenerationRequest(prompt=p, max_new_tokens=4, top_k=5) for p in ("the cat sat on", "a b c d")]
    got, want = engine.generate(reqs), ReferenceRunner(int8_base).generate(reqs)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for gs, ws in zip(g.logprobs, w.logprobs):
            assert max(abs(gs[t] - ws[t]) for t in ws if t in gs) < 1e-4


def test_int8_codes_dequantise_to_the_checkpoints_weights(engine, int8_base):
    from safetensors.torch import load_file

    floats = load_file(str(int8_base / "model.safetensors"))
    g = engine.model.model.layers[2].mlp.gate_proj.group  # gate and up: one group
    w = (g.quant.qt.t().float() * g.quant.scale[:, None])
    want = torch.cat([floats["model.layers.2.mlp.gate_proj.weight"], floats["model.layers.2.mlp.up_proj.weight"]])
    assert torch.equal(w, want)


def test_tensor_parallel_refuses_an_int8_base(int8_base):
    from lora_conformance.engines.base import UnsupportedFeatureError
    from lora_conformance.engines.builtin.layers import int8_linear

    class TwoRanks:
        size = 2

    with pytest.raises(UnsupportedFeatureError, match="tensor_parallel_size > 1"):
        int8_linear.attach(torch.nn.Module(), int8_base, int8_linear.QuantRules(), torch.float32, TwoRanks())
