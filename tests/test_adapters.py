"""Adapter synthesis: PEFT loads every variant, keys cover exactly the targets, calibration holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lora_conformance.adapters import (
    DEFAULT_ADAPTERS,
    AdapterSpec,
    adapter_hash,
    synthesize_adapter,
    synthesize_cached,
)
from lora_conformance.models import default_prompts, load_model, resolve_base_model
from lora_conformance.models.calibration import first_change, greedy, peft_with_adapter

LAYERS = 4




def keys(path: Path) -> list[str]:
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return sorted(f.keys())


def modules_of(ks: list[str]) -> set[str]:
    """Module names (as PEFT saves them) that carry LoRA tensors."""
    return {re.sub(r"\.(lora_\w+)(\.weight|\.bias)?$", "", k) for k in ks if ".lora_" in k}


def expected(names, layers=range(LAYERS), kind="self_attn"):
    return {f"base_model.model.model.layers.{i}.{kind}.{n}" for i in layers for n in names}


VARIANTS = {
    "qv": (AdapterSpec(), expected(["q_proj", "v_proj"])),
    "attention": (AdapterSpec(targets="attention"), expected(["q_proj", "k_proj", "v_proj", "o_proj"])),
    "mlp": (AdapterSpec(targets="mlp"), expected(["gate_proj", "up_proj", "down_proj"], kind="mlp")),
    "all-linear": (
        AdapterSpec(targets="all-linear"),
        expected(["q_proj", "k_proj", "v_proj", "o_proj"]) | expected(["gate_proj", "up_proj", "down_proj"], kind="mlp"),
    ),
    "embed_tokens": (AdapterSpec(targets="embed_tokens"), {"base_model.model.model.embed_tokens"}),
    "lm_head": (AdapterSpec(targets="lm_head"), {"base_model.model.lm_head"}),
    "rank1": (AdapterSpec(rank=1), expected(["q_proj", "v_proj"])),
    "rank64": (AdapterSpec(rank=64), expected(["q_proj", "v_proj"])),
    "rank256": (AdapterSpec(rank=256), expected(["q_proj", "v_proj"])),
    "rslora": (AdapterSpec(use_rslora=True), expected(["q_proj", "v_proj"])),
    "patterns": (AdapterSpec(rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 32}), expected(["q_proj", "v_proj"])),
    "layers": (AdapterSpec(layers_to_transform=(0, 2)), expected(["q_proj", "v_proj"], layers=(0, 2))),
    "dora": (AdapterSpec(use_dora=True), expected(["q_proj", "v_proj"])),
    "modules_to_save": (AdapterSpec(modules_to_save=("lm_head",)), expected(["q_proj", "v_proj"])),
    "bias": (AdapterSpec(bias="lora_only"), expected(["q_proj", "v_proj"])),
    "zero": (AdapterSpec(zero=True), expected(["q_proj", "v_proj"])),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_loads_variant_and_keys_cover_exactly_the_targets(llama, cache, variant):
    spec, want = VARIANTS[variant]
    path = synthesize_cached(llama, spec, cache)
    ks = keys(path)
    assert not [k for k in ks if ".base_layer." in k], ks
    assert modules_of(ks) == want
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["r"] == spec.rank and cfg["lora_alpha"] == spec.alpha
    model = peft_with_adapter(llama, path)  # raises on missing/unexpected adapter keys
    state = model.state_dict()
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        name = next(k for k in f.keys() if "lora_B" in k or "lora_embedding_B" in k)
        loaded = next(v for k, v in state.items() if k.replace(".default", "") == name)
        assert torch.equal(loaded, f.get_tensor(name))
    if variant == "patterns":
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert f.get_slice("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight").get_shape()[0] == 4
        assert cfg["alpha_pattern"] == {"q_proj": 32}
    if variant == "dora":
        assert any(k.endswith("lora_magnitude_vector") for k in ks)
    if variant == "modules_to_save":
        assert "base_model.model.lm_head.weight" in ks
        base = load_model(llama).lm_head.weight
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert not torch.equal(f.get_tensor("base_model.model.lm_head.weight"), base)  # a real replacement
    if variant == "bias":
        assert any(k.endswith("lora_B.bias") for k in ks)


def test_moe_expert_parameters(cache):
    moe = resolve_base_model("synthetic:moe", cache)
    path = synthesize_cached(moe, AdapterSpec(targets="moe_experts"), cache)
    ks = keys(path)
    # Two targeted parameters on one module nest: gate_up under base_layer, down_proj outside.
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in ks
    assert "base_model.model.model.layers.0.mlp.experts.lora_A.weight" in ks
    assert len(ks) == 4 * LAYERS
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    peft_with_adapter(moe, path)


def test_same_spec_same_bytes_and_cache_hit(llama, cache, tmp_path):
    spec = AdapterSpec(seed=5)
    a = synthesize_adapter(llama, spec, tmp_path / "a")
    b = synthesize_adapter(llama, spec, tmp_path / "b")
    assert adapter_hash(a) == adapter_hash(b)
    assert adapter_hash(a) != adapter_hash(synthesize_adapter(llama, AdapterSpec(seed=6), tmp_path / "c"))
    c1 = synthesize_cached(llama, spec, cache)
    assert synthesize_cached(llama, spec, cache) == c1 and adapter_hash(c1) == adapter_hash(a)


def test_spec_is_hashable_and_round_trips():
    spec = AdapterSpec(rank_pattern={"v_proj": 4}, layers_to_transform=[0, 1])
    assert hash(spec) == hash(AdapterSpec(rank_pattern={"v_proj": 4}, layers_to_transform=(0, 1)))
    assert AdapterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.cache_key() != AdapterSpec().cache_key()
    with pytest.raises(ValueError, match="rank"):
        AdapterSpec(rank=512)
    with pytest.raises(ValueError, match="targets"):
        AdapterSpec(targets="everything")


def test_zero_adapter_equals_base(llama, cache, tokenizer):
    prompts = default_prompts()[:4]
    base = greedy(load_model(llama), tokenizer, prompts, steps=4)
    zero = greedy(peft_with_adapter(llama, synthesize_cached(llama, AdapterSpec(zero=True), cache)), tokenizer, prompts, 4)
    assert torch.equal(base.tokens, zero.tokens)
    assert torch.allclose(base.margins, zero.margins, atol=1e-5)


def test_default_adapters_change_output_early_and_differ(llama, cache, tokenizer):
    prompts = default_prompts()
    base = greedy(load_model(llama), tokenizer, prompts, steps=8).tokens
    outs = {}
    for name, spec in DEFAULT_ADAPTERS.items():
        model = peft_with_adapter(llama, synthesize_cached(llama, spec, cache))
        outs[name] = greedy(model, tokenizer, prompts, steps=8).tokens
        early = [f < 4 for f in first_change(base, outs[name])]  # (a): changed within 4 tokens
        assert sum(early) >= 10, (name, first_change(base, outs[name]))
    names = list(outs)
    for i, a in enumerate(names):  # (b): distinct seeds give distinct outputs on most prompts
        for b in names[i + 1 :]:
            same = sum(torch.equal(x, y) for x, y in zip(outs[a], outs[b]))
            assert same <= 2, (a, b, same)
