"""Synthetic base models: layout, tokenizer, caching, and greedy stability across dtypes."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from lora_conformance.models import (
    SMALL_KINDS,
    content_hash,
    default_prompts,
    load_model,
    model_kind,
    resolve_base_model,
)
from lora_conformance.models.calibration import diverged, greedy, peft_with_adapter

BASE_MIN_MARGIN = 1.0  # nats; measured 1.45 (bench/model_margins.py), bf16 moves gaps by < 0.1




def test_default_prompts_are_words_of_the_vocabulary(tokenizer):
    prompts = default_prompts()
    assert len(prompts) == 16
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) >= 3 and max(lengths) <= 24, lengths
    for p in prompts:
        ids = tokenizer(p).input_ids
        assert tokenizer.unk_token_id not in ids, p
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == p  # words round-trip


@pytest.mark.parametrize("kind", SMALL_KINDS)  # the real shapes: tests/test_profiles.py
def test_synthetic_models_load_as_standard_checkpoints(cache, kind):
    from transformers import AutoTokenizer

    d = resolve_base_model(f"synthetic:{kind}", cache)
    assert model_kind(d) == {"moe": "moe", "encoder": "encoder"}.get(kind, "decoder")
    tok = AutoTokenizer.from_pretrained(str(d))
    # transformers 5 gives every model_type qwen2 checkpoint its Qwen2Tokenizer (words as added tokens)
    assert type(tok).__name__ in (("Qwen2Tokenizer",) if kind == "qwen2" else ("PreTrainedTokenizerFast", "TokenizersBackend"))
    model = load_model(d)
    ids = tok(["water and fire", "the old man"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**ids)
    if kind == "encoder":
        assert out.last_hidden_state.shape[-1] == 256
        assert json.loads((d / "pooling.json").read_text())["pooling"] == "mean"
    else:
        assert out.logits.shape[-1] == model.config.vocab_size == len(tok)


def _same_tokenizer(a, b, texts) -> None:
    assert type(a) is type(b)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "padding_side", "model_max_length"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.get_vocab() == b.get_vocab()
    ea, eb = a(texts, padding=True), b(texts, padding=True)
    assert ea["input_ids"] == eb["input_ids"] and ea["attention_mask"] == eb["attention_mask"]
    assert a.batch_decode(ea["input_ids"], skip_special_tokens=True) == b.batch_decode(eb["input_ids"],
                                                                                     skip_special_tokens=True)
    assert a.batch_decode(ea["input_ids"]) == b.batch_decode(eb["input_ids"])


@pytest.mark.parametrize("kind", SMALL_KINDS)  # the real shapes: tests/test_profiles.py
def test_a_remembered_tokenizer_class_gives_autotokenizers_tokenizer(cache, kind, tmp_path, monkeypatch):
    """load_tokenizer records AutoTokenizer's class choice; a later process that calls the class
    directly gets the same tokenizer (Qwen2's choice is not the class tokenizer_config.json names)."""
    from transformers import AutoTokenizer

    from lora_conformance.models import tokenizer as tk

    d = resolve_base_model(f"synthetic:{kind}", cache)
    first = tk.load_tokenizer(d, tmp_path / "tokenizers")  # AutoTokenizer, recorded
    (record,) = (tmp_path / "tokenizers").glob("*.json")
    assert json.loads(record.read_text())["class"] == type(first).__name__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("AutoTokenizer again"))
    second = tk.load_tokenizer(d, tmp_path / "tokenizers")
    monkeypatch.undo()
    texts = default_prompts()[:6] + ["water and fire", "unknownword the old man", ""]
    _same_tokenizer(AutoTokenizer.from_pretrained(str(d)), second, texts)
    _same_tokenizer(first, second, texts)


def test_tokenizer_records_are_keyed_by_files_and_fall_back(cache, tmp_path, monkeypatch):
    import shutil

    from lora_conformance.models import tokenizer as tk

    src = resolve_base_model("synthetic:llama", cache)
    d = tmp_path / "model"
    shutil.copytree(src, d)
    tk.load_tokenizer(d, tmp_path / "tokenizers")
    (record,) = (tmp_path / "tokenizers").glob("*.json")
    record.write_text('{"class": "NoSuchTokenizerClass"}')  # a class this transformers lacks
    assert type(tk.load_tokenizer(d, tmp_path / "tokenizers")).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    record.write_text("{not json")
    assert tk.load_tokenizer(d, tmp_path / "tokenizers").bos_token_id is not None
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, model_max_length=77)))
    assert tk._resolution_key(d) != record.stem  # another file, another key
    assert tk.load_tokenizer(d, tmp_path / "tokenizers").model_max_length == 77
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, auto_map={"AutoTokenizer": ["x.Y", None]})))
    assert tk._remote_code(d)  # remote code: never recorded, AutoTokenizer decides each time


def test_moe_keeps_fused_experts_in_memory(cache):
    model = load_model(resolve_base_model("synthetic:moe", cache))
    experts = model.model.layers[0].mlp.experts
    cfg = model.config
    assert experts.gate_up_proj.shape == (cfg.num_local_experts, 2 * cfg.intermediate_size, cfg.hidden_size)
    assert experts.down_proj.shape == (cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)


def test_llama_shape_fits_vllm(llama):
    cfg = json.loads((llama / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] >= 32 and cfg["tie_word_embeddings"] is False
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


def test_cache_is_content_addressed_and_reused(cache, llama):
    again = resolve_base_model("synthetic:llama", cache)
    assert again == llama
    h = content_hash(llama)
    assert len(h) == 64 and h == content_hash(again)
    other = resolve_base_model("synthetic:llama", cache, seed=1)
    assert other != llama and content_hash(other) != h


def _build(args):
    kind, cache = args
    return str(resolve_base_model(f"synthetic:{kind}", Path(cache)))


def test_concurrent_builds_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        a, b = pool.map(_build, [("encoder", str(tmp_path))] * 2)
    assert a == b
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")] == [Path(a).name]


def test_deterministic_weights(tmp_path, llama):
    rebuilt = resolve_base_model("synthetic:llama", tmp_path)
    assert (rebuilt / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()


def test_unknown_specs_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="synthetic:llama, synthetic:moe, synthetic:encoder"):
        resolve_base_model("synthetic:gpt", tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        resolve_base_model(str(tmp_path), tmp_path)


def test_base_greedy_is_dtype_stable_and_context_dependent(llama, tokenizer):
    model = load_model(llama)
    prompts = default_prompts()
    f32 = greedy(model, tokenizer, prompts)
    assert float(f32.margins.min()) >= BASE_MIN_MARGIN, f32.margins.min()
    for dtype in (torch.bfloat16, torch.float16):
        other = greedy(model, tokenizer, prompts, dtype=dtype)
        assert diverged(f32.tokens, other.tokens) == [], dtype
    # Different prompts continue differently and no continuation is a one-word loop.
    assert len({tuple(t) for t in f32.tokens.tolist()}) == len(prompts)
    assert all(len(set(t)) > 4 for t in f32.tokens.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["A", "B", "C", "D"])
def test_default_adapter_greedy_is_dtype_stable(cache, llama, tokenizer, name):
    from lora_conformance.adapters import DEFAULT_ADAPTERS, MIN_MARGIN, synthesize_cached

    model = peft_with_adapter(llama, synthesize_cached(llama, DEFAULT_ADAPTERS[name], cache))
    prompts = default_prompts()
    f32 = greedy(model, tokenizer, prompts)
    assert float(f32.margins.min()) >= MIN_MARGIN, f32.margins.min()
    for dtype in (torch.bfloat16, torch.float16):
        assert diverged(f32.tokens, greedy(model, tokenizer, prompts, dtype=dtype).tokens) == [], dtype


def test_base_model_variants(cache, llama):
    """head_dim 128 / 256 variants; qwen2: q/k/v biases, tied embeddings, the word-level token ids."""
    import json as _json

    from transformers import AutoTokenizer

    for kind, hd in (("llama-hd128", 128), ("llama-hd256", 256)):
        cfg = _json.loads((resolve_base_model(f"synthetic:{kind}", cache) / "config.json").read_text())
        assert cfg["head_dim"] == hd and cfg["model_type"] == "llama", cfg
    q = resolve_base_model("synthetic:qwen2", cache)
    cfg = _json.loads((q / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True
    model = load_model(q)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[1].self_attn.q_proj.bias.abs().max() > 0
    text = "the old man and water and fire"
    assert (AutoTokenizer.from_pretrained(str(q))(text)["input_ids"]
            == AutoTokenizer.from_pretrained(str(llama))(text)["input_ids"])
