"""The llamacpp engine and our GGUF converters, against independent oracles: HF transformers + a
plain single-adapter PeftModel, one prompt at a time, greedy by full forwards.

The converter tests need only the ``gguf`` package (they read the written files back); the engine
tests need llama-cpp-python and are skipped without it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_adapter, build_llama, greedy_oracle  # noqa: E402

from lora_conformance.engines.base import UnsupportedFeatureError  # noqa: E402
from lora_conformance.engines.llamacpp_convert import (  # noqa: E402
    convert_adapter,
    convert_model,
    interleave_heads,
    module_scaling,
)
from lora_conformance.types import GenerationRequest  # noqa: E402

PROMPTS = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
ATOL = 2e-3  # float32 logprobs, llama.cpp's cpu kernels (flash attention off) against torch's


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp_engine")
    base = build_llama(root / "llama")
    return {
        "root": root,
        "base": base,
        "all": build_adapter(base, root / "all", seed=1),
        "rs": build_adapter(base, root / "rs", seed=2, r=4, alpha=8, use_rslora=True,
                            rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 3},
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "emb": build_adapter(base, root / "emb", seed=3, target_modules=["embed_tokens", "lm_head", "q_proj"]),
        "dora": build_adapter(base, root / "dora", seed=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    }


def _rope_half(x, pos, theta=10000.0):
    """HF llama's rotation: the two halves of each head rotate together."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _rope_pairs(x, pos, theta=10000.0):
    """llama.cpp's ``llama`` rotation: adjacent pairs rotate together."""
    d = x.shape[-1]
    ang = pos / theta ** (np.arange(0, d, 2) / d)
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * np.cos(ang) - x[..., 1::2] * np.sin(ang)
    out[..., 1::2] = x[..., 0::2] * np.sin(ang) + x[..., 1::2] * np.cos(ang)
    return out


def test_interleaving_heads_turns_half_rotation_into_pair_rotation():
    rng = np.random.default_rng(0)
    n_head, head_dim, hidden = 3, 8, 5
    w = rng.standard_normal((n_head * head_dim, hidden))
    x = rng.standard_normal(hidden)
    for pos in (0, 1, 7):
        hf = _rope_half((w @ x).reshape(n_head, head_dim), pos)
        cpp = _rope_pairs((interleave_heads(w, n_head) @ x).reshape(n_head, head_dim), pos)
        # the same dot products between heads: the layouts differ only by a per-head permutation
        np.testing.assert_allclose(hf @ hf.T, cpp @ cpp.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.sort(hf, -1), np.sort(cpp, -1), rtol=1e-12, atol=1e-12)


def _read_lora(path: Path) -> tuple[float, dict[str, np.ndarray]]:
    r = gguf.GGUFReader(str(path))
    alpha = float(r.fields["adapter.lora.alpha"].parts[-1][0])
    return alpha, {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in r.tensors}


def test_adapter_conversion_keeps_peft_scaling_per_module(ckpt, tmp_path):
    """llama.cpp scales by alpha / (the tensor's rank): rsLoRA, rank and alpha patterns survive."""
    from safetensors.numpy import load_file

    from lora_conformance.checkpoints import read_adapter_config

    cfg = read_adapter_config(ckpt["rs"])
    peft = load_file(str(ckpt["rs"] / "adapter_model.safetensors"))
    alpha, tensors = _read_lora(convert_adapter(ckpt["rs"], ckpt["base"], tmp_path))
    n_head = 2
    for module, target in (("model.layers.0.self_attn.q_proj", "blk.0.attn_q"),
                           ("model.layers.1.self_attn.v_proj", "blk.1.attn_v"),
                           ("model.layers.1.self_attn.o_proj", "blk.1.attn_output")):
        A = peft[f"base_model.model.{module}.lora_A.weight"]
        B = peft[f"base_model.model.{module}.lora_B.weight"]
        r, scaling = module_scaling(cfg, module)
        a, b = tensors[f"{target}.weight.lora_a"], tensors[f"{target}.weight.lora_b"]
        assert a.shape == (r, A.shape[1]) and b.shape == (B.shape[0], r)
        want = scaling * (B @ A)
        if target.endswith("attn_q"):
            want = interleave_heads(want, n_head)
        np.testing.assert_allclose(alpha / r * (b @ a), want, rtol=1e-5, atol=1e-6)
    assert module_scaling(cfg, "model.layers.1.self_attn.v_proj") == (2, 8 / math.sqrt(2))
    assert module_scaling(cfg, "model.layers.1.self_attn.o_proj") == (4, 3 / math.sqrt(4))


def test_embedding_lora_is_written_as_rows_of_the_token_embedding(ckpt, tmp_path):
    from safetensors.numpy import load_file

    peft = load_file(str(ckpt["emb"] / "adapter_model.safetensors"))
    _, tensors = _read_lora(convert_adapter(ckpt["emb"], ckpt["base"], tmp_path))
    A = peft["base_model.model.model.embed_tokens.lora_embedding_A"]  # (r, vocab)
    B = peft["base_model.model.model.embed_tokens.lora_embedding_B"]  # (hidden, r)
    a, b = tensors["token_embd.weight.lora_a"], tensors["token_embd.weight.lora_b"]
    assert a.shape == (A.shape[1], A.shape[0]) and b.shape == B.shape  # (vocab, r), (hidden, r)
    np.testing.assert_allclose(a @ b.T, (B @ A).T, rtol=1e-5, atol=1e-6)  # token rows of the delta


def test_what_gguf_lora_cannot_hold_is_refused_with_the_reason(ckpt, tmp_path):
    with pytest.raises(UnsupportedFeatureError, match="DoRA"):
        convert_adapter(ckpt["dora"], ckpt["base"], tmp_path)


def test_model_conversion_is_cached_by_content(ckpt, tmp_path):
    first = convert_model(ckpt["base"], tmp_path, "float32")
    stamp = first.stat().st_mtime_ns
    assert convert_model(ckpt["base"], tmp_path, "float32") == first and first.stat().st_mtime_ns == stamp
    assert convert_model(ckpt["base"], tmp_path, "float16") != first


# ---- llama.cpp itself ----------------------------------------------------------------------


def _float32_engine(built):
    """A float32 llama.cpp engine on ``built``'s base (its GGUF cache beside it), closed after the module."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'lora-conformance[llamacpp]')")
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine

    e = LlamaCppEngine(built["base"], "cpu", "float32", {"gguf_cache": str(built["root"] / "gguf"), "n_threads": "2"})
    yield e
    e.close()


@pytest.fixture(scope="module")
def engine(ckpt):
    yield from _float32_engine(ckpt)


@pytest.mark.parametrize("adapter", [None, "all", "rs", "emb"])
def test_engine_matches_the_peft_oracle(engine, ckpt, adapter):
    if adapter is not None and adapter not in engine.list_adapters():
        engine.load_adapter(adapter, ckpt[adapter])
    steps = 6
    reqs = [GenerationRequest(p, adapter=adapter, max_new_tokens=steps, top_k=3, prompt_logprobs=True) for p in PROMPTS]
    for req, got in zip(reqs, engine.generate(reqs)):
        prompt_ids, ids, rows = greedy_oracle(ckpt["base"], None if adapter is None else ckpt[adapter], req.prompt, steps)
        assert got.prompt_token_ids == prompt_ids
        assert got.token_ids == ids, (adapter, req.prompt)
        for step, (top, row) in enumerate(zip(got.logprobs, rows)):
            for tid, lp in top.items():
                assert abs(lp - float(row[tid])) < ATOL, (adapter, req.prompt, step, tid, lp, float(row[tid]))
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(prompt_ids) - 1


def test_adapters_change_the_output_and_unload_restores_the_base(engine, ckpt):
    req = [GenerationRequest(PROMPTS[0], adapter=None, max_new_tokens=6, top_k=2)]
    base = engine.generate(req)[0]
    engine.load_adapter("x", ckpt["all"])
    with_x = engine.generate([GenerationRequest(PROMPTS[0], adapter="x", max_new_tokens=6, top_k=2)])[0]
    assert with_x.logprobs != base.logprobs  # the adapter is applied
    engine.unload_adapter("x")
    assert "x" not in engine.list_adapters()
    assert engine.generate(req)[0].logprobs == base.logprobs  # and gone again


def test_settings_name_what_differs_from_llama_cpp_defaults(engine):
    s = engine.settings()
    assert s["effective"]["flash_attn"] == "off" and "flash_attn" in s["differs_from_engine_default"]
    assert "mixed_batch" in s["not_declared"]


# ---- MoE (Mixtral) and BERT bases ------------------------------------------------------------

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from _tiny_models import build_moe

    root = tmp_path_factory.mktemp("llamacpp_moe")
    base = build_moe(root / "moe")
    return {"root": root, "base": base,
            "experts": build_adapter(base, root / "experts", seed=5, r=4, alpha=8, target_modules=[],
                                     target_parameters=EXPERT_PARAMS),
            "attn": build_adapter(base, root / "attn", seed=6, target_modules=["q_proj", "k_proj", "v_proj"])}


def test_moe_base_is_written_as_llama_cpp_expert_tensors(moe, tmp_path):
    cfg = json.loads((moe["base"] / "config.json").read_text())
    reader = gguf.GGUFReader(str(convert_model(moe["base"], tmp_path, "float32")))
    shapes = {t.name: [int(n) for n in reversed(t.shape)] for t in reader.tensors}
    E, I, H = cfg["num_local_experts"], cfg["intermediate_size"], cfg["hidden_size"]
    assert shapes["blk.0.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == [E, I, H]
    assert shapes["blk.0.ffn_down_exps.weight"] == [E, H, I]
    assert shapes["blk.0.ffn_gate_inp.weight"] == [E, H]
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == E


def test_expert_lora_is_written_per_expert(moe, tmp_path):
    cfg = json.loads((moe["base"] / "config.json").read_text())
    alpha, tensors = _read_lora(convert_adapter(moe["experts"], moe["base"], tmp_path))
    E, I, H, r = cfg["num_local_experts"], cfg["intermediate_size"], cfg["hidden_size"], 4
    assert tensors["blk.0.ffn_gate_exps.weight.lora_a"].shape == (E, r, H)
    assert tensors["blk.0.ffn_gate_exps.weight.lora_b"].shape == (E, I, r)
    assert tensors["blk.0.ffn_down_exps.weight.lora_a"].shape == (E, r, I)
    assert tensors["blk.0.ffn_down_exps.weight.lora_b"].shape == (E, H, r)
    # gate and up share A; their B are the two halves of gate_up's B
    np.testing.assert_array_equal(tensors["blk.0.ffn_gate_exps.weight.lora_a"], tensors["blk.0.ffn_up_exps.weight.lora_a"])


def test_bert_base_and_its_lora_are_written_as_llama_cpp_bert(tmp_path):
    from _tiny_models import build_bert

    base = build_bert(tmp_path / "bert")
    reader = gguf.GGUFReader(str(convert_model(base, tmp_path / "gguf", "float32")))
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "position_embd.weight", "token_types.weight", "token_embd_norm.bias",
            "blk.1.attn_q.bias", "blk.1.attn_output_norm.weight", "blk.1.ffn_up.weight",
            "blk.1.layer_output_norm.bias"} <= names
    assert str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") == "bert"
    assert int(reader.fields["bert.pooling_type"].parts[-1][0]) == 1  # mean, as the reference pools
    adapter = build_adapter(base, tmp_path / "qv", seed=7, model_cls="encoder", target_modules=["query", "value"])
    _, tensors = _read_lora(convert_adapter(adapter, base, tmp_path / "gguf"))
    assert {"blk.0.attn_q.weight.lora_a", "blk.1.attn_v.weight.lora_b"} <= set(tensors)


@pytest.fixture(scope="module")
def moe_engine(moe):
    yield from _float32_engine(moe)


@pytest.mark.parametrize("adapter", [None, "experts", "attn"])
def test_moe_engine_matches_the_peft_oracle(moe_engine, moe, adapter):
    assert "moe" in {c.value for c in moe_engine.capabilities}
    if adapter is not None and adapter not in moe_engine.list_adapters():
        moe_engine.load_adapter(adapter, moe[adapter])
    steps = 5
    for prompt in PROMPTS:
        got = moe_engine.generate([GenerationRequest(prompt, adapter=adapter, max_new_tokens=steps, top_k=3)])[0]
        _, ids, rows = greedy_oracle(moe["base"], None if adapter is None else moe[adapter], prompt, steps)
        assert got.token_ids == ids, (adapter, prompt)
        for step, (top, row) in enumerate(zip(got.logprobs, rows)):
            for tid, lp in top.items():
                assert abs(lp - float(row[tid])) < ATOL, (adapter, prompt, step, tid, lp, float(row[tid]))
