"""One reader of checkpoints and adapters (lora_conformance.checkpoints) and one atomic writer
(lora_conformance.fileio): the kind of a checkpoint is decided by one rule that the harness, the
reference and the engines all follow; adapter configs and LoRA tensor names are read one way."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from lora_conformance import checkpoints, fileio
from lora_conformance.engines.base import AdapterFormatError, AdapterIncompatibleError

# config.json as transformers writes it for each family (the fields the rule can look at).
CONFIGS = {
    "bert": ({"model_type": "bert", "architectures": ["BertModel"], "is_decoder": False}, "encoder"),
    "bert-masked-lm": ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "encoder"),
    "bert-lm-head": ({"model_type": "bert", "architectures": ["BertLMHeadModel"], "is_decoder": True}, "decoder"),
    "roberta": ({"model_type": "roberta", "architectures": ["RobertaModel"]}, "encoder"),
    "roberta-masked-lm": ({"model_type": "roberta", "architectures": ["RobertaForMaskedLM"]}, "encoder"),
    "xlm-roberta-no-architectures": ({"model_type": "xlm-roberta"}, "encoder"),
    "llama": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "decoder"),
    # transformers 4 wrote every default, is_decoder: false included; a llama is still a decoder.
    "llama-is_decoder-false": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                "is_decoder": False}, "decoder"),
    "llama-no-architectures": ({"model_type": "llama"}, "decoder"),
    "llama-headless": ({"model_type": "llama", "architectures": ["LlamaModel"]}, "encoder"),
    "qwen2": ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
              "decoder"),
    "mixtral": ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8},
                "moe"),
    "qwen2_moe": ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4},
                  "moe"),
}


def _checkpoint(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[name][0]))
    return d


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_rule_decides_encoder_decoder_and_moe(tmp_path, name):
    d = _checkpoint(tmp_path, name)
    assert checkpoints.model_kind(d) == CONFIGS[name][1]
    assert checkpoints.is_encoder(d) == (CONFIGS[name][1] == "encoder")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_harness_reference_and_engines_agree_on_the_kind(tmp_path, name):
    """The three places that ask for a model's kind (the harness's models.model_kind, the reference's
    loader, the engine plugins' is_encoder_only) give the same answer as the rule."""
    from lora_conformance.engines._hf_common import is_encoder_only
    from lora_conformance.models import model_kind
    from lora_conformance.reference import ReferenceRunner

    d = _checkpoint(tmp_path, name)
    kind = CONFIGS[name][1]
    assert model_kind(d) == kind
    assert ReferenceRunner(d).is_encoder == (kind == "encoder")
    assert is_encoder_only(d) == (kind == "encoder")


def test_real_configs_from_transformers(tmp_path):
    """The rule on config.json files written by transformers' own config classes."""
    import transformers

    for cls, arch, kind in ((transformers.BertConfig, "BertModel", "encoder"),
                            (transformers.RobertaConfig, "RobertaModel", "encoder"),
                            (transformers.LlamaConfig, "LlamaForCausalLM", "decoder"),
                            (transformers.Qwen2Config, "Qwen2ForCausalLM", "decoder"),
                            (transformers.MixtralConfig, "MixtralForCausalLM", "moe")):
        d = tmp_path / cls.__name__
        cfg = cls()
        cfg.architectures = [arch]
        cfg.save_pretrained(str(d))
        assert checkpoints.model_kind(d) == kind, cls.__name__


def test_builtin_engine_refuses_a_checkpoint_of_the_other_kind(tmp_path):
    """The built-in engine serves bert as an encoder and llama as a decoder; a config the rule calls
    the other kind (a head-less LlamaModel) is refused by name, not served as what it is not."""
    from lora_conformance.engines.base import UnsupportedFeatureError
    from lora_conformance.engines.builtin.models.config import load_spec

    d = tmp_path / "llama-headless"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaModel"], "vocab_size": 10, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16}))
    with pytest.raises(UnsupportedFeatureError, match="serves llama only as a decoder"):
        load_spec(d)


def test_unreadable_config_is_not_an_encoder(tmp_path):
    assert checkpoints.is_encoder(tmp_path) is False  # no config.json: the loader says what is wrong
    with pytest.raises(OSError):
        checkpoints.model_kind(tmp_path)


# ---- adapters -------------------------------------------------------------------------------


@pytest.mark.parametrize("content, field", [
    (None, "file"), (b"\xff\xfe", "encoding"), (b"{not json", "json"), (b"[1, 2]", "json"),
])
def test_adapter_config_errors_name_the_file_and_field(tmp_path, content, field):
    if content is not None:
        (tmp_path / "adapter_config.json").write_bytes(content)
    with pytest.raises(AdapterFormatError) as info:
        checkpoints.read_adapter_config(tmp_path)
    assert info.value.field == field
    assert info.value.file.endswith("adapter_config.json")
    assert isinstance(info.value, AdapterIncompatibleError)  # what engines catch


def test_adapter_dir_that_is_not_a_directory(tmp_path):
    with pytest.raises(AdapterFormatError, match="is not a directory"):
        checkpoints.read_adapter_config(tmp_path / "missing")


def test_adapter_info_summarises_the_config(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "rank_pattern": {"v_proj": 16}, "target_modules": "all-linear",
        "use_rslora": True, "modules_to_save": ["lm_head"]}))
    info = checkpoints.adapter_info(tmp_path)
    assert (info.rank, info.max_rank, info.use_rslora, info.has_rank_pattern) == (4, 16, True, True)
    assert info.target_modules == ("all-linear",) and info.modules_to_save == ("lm_head",)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(AdapterFormatError, match="peft_type"):
        checkpoints.adapter_info(tmp_path)


@pytest.mark.parametrize("key, expected", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
     ("model.layers.0.self_attn.q_proj", "A", False, 0)),
    ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight",
     ("model.layers.0.mlp.experts", "B", False, 1)),
    ("base_model.model.model.embed_tokens.lora_embedding_A", ("model.embed_tokens", "A", True, 0)),
    ("base_model.model.lm_head.lora_B.weight", ("lm_head", "B", False, 0)),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
     ("model.layers.0.self_attn.q_proj.lora_magnitude_vector", "", False, 0)),
])
def test_split_lora_key(key, expected):
    k = checkpoints.split_lora_key(key)
    assert (k.module, k.factor, k.embedding, k.depth) == expected


def test_pattern_value_is_a_dot_bounded_suffix_match_first_wins():
    pat = {"v_proj": 16, "layers.1.self_attn.q_proj": 2, "q_proj": 8}
    assert checkpoints.pattern_value(pat, "model.layers.0.self_attn.v_proj", 4) == 16
    assert checkpoints.pattern_value(pat, "model.layers.1.self_attn.q_proj", 4) == 2
    assert checkpoints.pattern_value(pat, "model.layers.0.self_attn.q_proj", 4) == 8
    assert checkpoints.pattern_value(pat, "model.layers.0.self_attn.xq_proj", 4) == 4  # not dot-bounded


def test_dtype_names():
    import torch

    assert [checkpoints.torch_dtype(n) for n in checkpoints.DTYPE_NAMES] == [torch.float32, torch.bfloat16,
                                                                           torch.float16]
    with pytest.raises(ValueError, match="float64.*float32, bfloat16, float16"):
        checkpoints.torch_dtype("float64")


# ---- atomic writes --------------------------------------------------------------------------


def test_write_json_atomic_leaves_no_temp_file_on_failure(tmp_path):
    target = tmp_path / "sub" / "x.json"
    fileio.write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        fileio.write_json_atomic(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}  # the old file, whole
    assert [p.name for p in target.parent.iterdir()] == ["x.json"]


def test_build_directory_once_builds_once_under_a_race(tmp_path):
    final, builds = tmp_path / "cache" / "thing", []

    def build(tmp: Path) -> None:
        builds.append(tmp)
        (tmp / "done").write_text("x")

    threads = [threading.Thread(target=fileio.build_directory_once,
                                args=(final, lambda d: (d / "done").is_file(), build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and (final / "done").read_text() == "x"
    assert sorted(p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")) == ["thing"]


def test_build_directory_once_failure_leaves_nothing(tmp_path):
    final = tmp_path / "thing"

    def build(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        fileio.build_directory_once(final, lambda d: (d / "done").is_file(), build)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# ---- PEFT's scaling, one copy ------------------------------------------------------------

# Adapter configs as adapter_config.json may hold them: lora_alpha or r missing (PEFT's defaults,
# 8 and 8), rsLoRA, and rank / alpha patterns.
SCALING_CONFIGS = {
    "no-r-no-alpha": {},
    "no-alpha": {"r": 4},
    "no-alpha-rslora": {"r": 16, "use_rslora": True},
    "alpha": {"r": 4, "lora_alpha": 12},
    "rslora": {"r": 4, "lora_alpha": 6, "use_rslora": True},
    "patterns": {"r": 4, "lora_alpha": 16, "rank_pattern": {"v_proj": 2},
                 "alpha_pattern": {"layers.1.q_proj": 3}},
    "patterns-no-alpha-rslora": {"r": 4, "use_rslora": True, "rank_pattern": {"layers.0.v_proj": 16},
                                 "alpha_pattern": {"q_proj": 5}},
}


def _tiny_peft_model(cfg: dict):
    import torch
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

    return get_peft_model(Tiny(), LoraConfig(target_modules=["q_proj", "v_proj"], **cfg))


def test_peft_s_defaults_are_the_shared_ones():
    pytest.importorskip("peft")
    from peft import LoraConfig

    assert (LoraConfig().r, LoraConfig().lora_alpha) == (checkpoints.PEFT_DEFAULT_R, checkpoints.PEFT_DEFAULT_ALPHA)


@pytest.mark.parametrize("name", sorted(SCALING_CONFIGS))
def test_peft_scaling_is_peft_s_own_per_module(name):
    """checkpoints.peft_scaling / module_rank_alpha against PEFT's LoraLayer.scaling / r / lora_alpha."""
    pytest.importorskip("peft")
    from peft.tuners.lora.layer import LoraLayer

    cfg = SCALING_CONFIGS[name]
    layers = [(n.removeprefix("base_model.model."), m) for n, m in _tiny_peft_model(cfg).named_modules()
              if isinstance(m, LoraLayer)]
    assert len(layers) == 4
    for module, layer in layers:
        assert checkpoints.module_rank_alpha(cfg, module) == (layer.r["default"], layer.lora_alpha["default"]), module
        assert checkpoints.peft_scaling(cfg, module) == pytest.approx(layer.scaling["default"], rel=1e-12), module
    if name.startswith("no-alpha"):  # PEFT's 8, not r (what the OpenVINO plugin once assumed)
        assert checkpoints.module_rank_alpha(cfg)[1] == 8 != cfg["r"]


def _no_alpha_config(tmp_path: Path, **cfg) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"], **cfg}))
    return tmp_path


@pytest.mark.parametrize("rslora, want", [(False, 8 / 4), (True, 8 / 2)])
def test_openvino_blend_weight_without_lora_alpha_is_peft_s(tmp_path, rslora, want):
    """GenAI never reads adapter_config.json: the plugin's blend weight must be PEFT's scaling,
    lora_alpha defaulting to 8 (it was r: 1.0 here, half of PEFT's)."""
    from lora_conformance.engines._hf_common import read_adapter_info
    from lora_conformance.engines.openvino_adapters import adapter_scaling

    info = read_adapter_info(_no_alpha_config(tmp_path, r=4, use_rslora=rslora))
    assert adapter_scaling(info) == pytest.approx(want)


def test_llamacpp_converter_scaling_without_lora_alpha_is_peft_s():
    from lora_conformance.engines.llamacpp_convert import module_scaling

    cfg = {"r": 4, "rank_pattern": {"v_proj": 2}}
    assert module_scaling(cfg, "model.layers.0.self_attn.q_proj") == (4, 8 / 4)
    assert module_scaling(cfg, "model.layers.0.self_attn.v_proj") == (2, 8 / 2)
    assert module_scaling({**cfg, "use_rslora": True}, "model.layers.0.self_attn.q_proj") == (4, 8 / 2)


def test_llamacpp_gguf_of_an_adapter_without_lora_alpha(tmp_path):
    """The converted GGUF LoRA, as llama.cpp applies it (GGUF alpha / tensor rank x lora_b @ lora_a),
    is PEFT's delta: lora_alpha 8 where the config has none."""
    pytest.importorskip("peft")
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from safetensors.numpy import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny_models import build_adapter, build_llama

    from lora_conformance.engines.llamacpp_convert import convert_adapter

    base = build_llama(tmp_path / "llama")
    ad = build_adapter(base, tmp_path / "ad", seed=1, r=4, target_modules=["v_proj", "o_proj"],
                       rank_pattern={"o_proj": 2})
    cfg = json.loads((ad / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    reader = gguf.GGUFReader(str(convert_adapter(ad, base, tmp_path / "gguf")))
    alpha = float(reader.fields["adapter.lora.alpha"].parts[-1][0])
    got = {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}
    peft = load_file(str(ad / "adapter_model.safetensors"))
    assert alpha == 8
    for module, target, scaling in (("model.layers.1.self_attn.v_proj", "blk.1.attn_v", 8 / 4),
                                    ("model.layers.1.self_attn.o_proj", "blk.1.attn_output", 8 / 2)):
        a, b = got[f"{target}.weight.lora_a"], got[f"{target}.weight.lora_b"]
        A, B = (peft[f"base_model.model.{module}.lora_{f}.weight"] for f in "AB")
        want = scaling * (B @ A)
        np.testing.assert_allclose(alpha / a.shape[0] * (b @ a), want, rtol=1e-5, atol=1e-6)


def test_builtin_engine_serves_an_adapter_without_lora_alpha_as_the_reference(tmp_path):
    """An adapter_config.json without lora_alpha, through the built-in engine and through the
    reference (HF + PEFT): the same logprobs; and different from the adapter with lora_alpha = r
    (the wrong default), so the check can tell them apart."""
    pytest.importorskip("peft")
    from lora_conformance.adapters import AdapterSpec, synthesize_adapter
    from lora_conformance.judge import ConformanceAssertionError, assert_logprobs_close
    from lora_conformance.engines import create_engine
    from lora_conformance.models import resolve_base_model
    from lora_conformance.reference import ReferenceRunner
    from lora_conformance.types import GenerationRequest

    model = resolve_base_model("synthetic:llama", tmp_path / "models")
    dirs = {}
    for name, alpha in (("missing", None), ("alpha_r", 4)):
        d = synthesize_adapter(model, AdapterSpec(seed=1, rank=4), tmp_path / name)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.pop("lora_alpha")
        if alpha is not None:
            cfg["lora_alpha"] = alpha
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        dirs[name] = d
    requests = [GenerationRequest("once upon a time there was a dragon who", adapter=a, max_new_tokens=6, top_k=5)
                for a in dirs]
    references = ReferenceRunner(model).generate(requests, dirs)
    engine = create_engine("builtin", model, "cpu", "float32", {})
    try:
        engine.load_adapter("missing", dirs["missing"])
        out = engine.generate(requests[:1])[0]
    finally:
        engine.close()
    assert_logprobs_close(out, references[0], "float32")
    with pytest.raises(ConformanceAssertionError):
        assert_logprobs_close(out, references[1], "float32")
