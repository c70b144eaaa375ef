"""The openvino engine (OpenVINO GenAI) against an independent oracle: a plain single-adapter
PeftModel, one prompt at a time, greedy by full forwards. Skipped when openvino-genai is not
installed; the device mapping, scaling and refusals need no OpenVINO."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_adapter, build_bert, build_llama, build_moe, greedy_oracle  # noqa: E402

from lora_conformance.engines._hf_common import read_adapter_info  # noqa: E402
from lora_conformance.engines.base import (  # noqa: E402
    AdapterNotLoadedError,
    Capability,
    UnsupportedFeatureError,
)
from lora_conformance.engines.openvino_adapters import (  # noqa: E402
    adapter_scaling,
    module_scalings,
    split_by_module,
)
from lora_conformance.engines.openvino_engine import openvino_device  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402

ATOL = 1e-4  # float32 logprobs: OpenVINO's CPU kernels against torch's
PROMPTS = ["the cat sat on the mat", "a dog", "one two three four five six seven"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("openvino_engine")
    base = build_llama(root / "llama")
    return {
        "root": root,
        "base": base,
        "a1": build_adapter(base, root / "a1", seed=1),
        "a2": build_adapter(base, root / "a2", seed=2, r=4, alpha=8, use_rslora=True,
                            target_modules=["q_proj", "v_proj", "lm_head"]),
        "qv": build_adapter(base, root / "qv", seed=3, target_modules=["q_proj", "v_proj"]),
        "emb": build_adapter(base, root / "emb", seed=4, target_modules=["embed_tokens", "v_proj"]),
        "pattern": build_adapter(base, root / "pattern", seed=5, alpha_pattern={"q_proj": 32},
                                 rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 2}),
        "dora": build_adapter(base, root / "dora", seed=6, target_modules=["q_proj", "v_proj"], use_dora=True),
    }


def oracle(base_dir: Path, adapter_dir, prompt: str, steps: int):
    """(prompt ids, generated ids, chosen-token logprobs) from the PEFT oracle."""
    prompt_ids, ids, rows = greedy_oracle(base_dir, adapter_dir, prompt, steps)
    return prompt_ids, ids, [float(row[t]) for row, t in zip(rows, ids)]


# ---- no OpenVINO needed ------------------------------------------------------------------


def test_device_names_map_onto_openvino_plugins():
    assert [openvino_device(d) for d in ("cpu", "xpu", "xpu:1", "npu")] == ["CPU", "GPU", "GPU.1", "NPU"]
    with pytest.raises(UnsupportedFeatureError, match="no OpenVINO plugin"):
        openvino_device("cuda:0")


def test_scaling_is_peft_s_alpha_over_r_or_sqrt_r(ckpt):
    assert adapter_scaling(read_adapter_info(ckpt["a1"])) == pytest.approx(16 / 8)
    assert adapter_scaling(read_adapter_info(ckpt["a2"])) == pytest.approx(8 / math.sqrt(4))


def test_patterns_give_peft_s_scaling_per_module(ckpt):
    """r 8, alpha 16: q_proj takes alpha 32 (alpha_pattern), v_proj r 4, layer 1's q_proj r 2."""
    got = module_scalings(read_adapter_info(ckpt["pattern"]))
    assert got["model.layers.0.self_attn.k_proj"] == pytest.approx(16 / 8)
    assert got["model.layers.0.self_attn.q_proj"] == pytest.approx(32 / 8)
    assert got["model.layers.1.self_attn.q_proj"] == pytest.approx(32 / 2)
    assert got["model.layers.0.self_attn.v_proj"] == got["model.layers.1.self_attn.v_proj"] == pytest.approx(16 / 4)


def test_split_by_module_keeps_every_tensor_byte_for_byte(ckpt, tmp_path):
    """Each group's blob is a safetensors file of exactly its modules' A and B, with the original
    bytes; together the blobs hold every tensor once (the rest go with the first group)."""
    from safetensors.torch import load, load_file

    weights = ckpt["dora"] / "adapter_model.safetensors"  # LoRA factors and DoRA magnitudes
    whole = load_file(str(weights))
    q = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in whole if ".q_proj.lora_A" in k}
    blobs = split_by_module(weights, [q, {m.replace("q_proj", "v_proj") for m in q}])
    parts = [load(b) for b in blobs]
    assert sorted(k for p in parts for k in p) == sorted(whole)
    assert all(".q_proj." in k or "magnitude" in k for k in parts[0])
    assert all(".v_proj.lora_" in k for k in parts[1]) and parts[1]
    for p in parts:
        for k, v in p.items():
            assert torch.equal(v, whole[k]), k


def test_converter_refuses_encoders_naming_genai_and_unknown_models_before_tracing(ckpt, tmp_path):
    from lora_conformance.engines.openvino_convert import UnsupportedModelError, check_convertible

    assert check_convertible(build_moe(tmp_path / "moe"))["model_type"] == "mixtral"  # GenAI's LLM path serves MoE
    with pytest.raises(UnsupportedModelError, match="TextEmbeddingPipeline, which takes no LoRA adapters"):
        check_convertible(build_bert(tmp_path / "bert"))
    assert check_convertible(ckpt["base"])["model_type"] == "llama"
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    cfg = json.loads((ckpt["base"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope_type 'linear'"):
        check_convertible(scaled)


# ---- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(ckpt):
    pytest.importorskip("openvino_genai")
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    eng = OpenVINOEngine(ckpt["base"], "cpu", "float32", {"ir_cache": str(ckpt["root"] / "ir")})
    yield eng
    eng.close()


def test_declares_what_genai_supports(engine):
    assert engine.capabilities == {Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.RANK_PATTERN,
                                   Capability.LM_HEAD, Capability.PREFIX_CACHE, Capability.EMBED_TOKENS,
                                   Capability.CHUNKED_PREFILL}
    assert engine.limits.max_loras_per_batch == 1
    assert type(engine).exec_modes("cpu") == {"exec_mode": ("compiled",)}  # OpenVINO's one way to run a model
    reasons = type(engine).not_declared_reasons(engine.cfg, engine.model_dir, "cpu")
    assert "pipeline_impl.cpp#L570-L575" in reasons[Capability.MIXED_BATCH]
    assert not set(reasons) & engine.capabilities


def test_every_row_matches_its_own_single_adapter_oracle(engine, ckpt):
    engine.load_adapter("a1", ckpt["a1"])
    engine.load_adapter("a2", ckpt["a2"])  # rsLoRA + lm_head: a new module set, so a new pipeline
    adapters = [None, "a1", "a2", "a1", None]
    requests = [GenerationRequest(PROMPTS[i % 3], adapter=a, max_new_tokens=6) for i, a in enumerate(adapters)]
    outputs = engine.generate(requests)
    for req, out in zip(requests, outputs):
        prompt_ids, ids, lps = oracle(ckpt["base"], ckpt[req.adapter] if req.adapter else None, req.prompt, 6)
        assert out.prompt_token_ids == prompt_ids, (out.prompt_token_ids, prompt_ids)
        assert out.token_ids == ids, f"adapter {req.adapter}: {out.token_ids} != oracle {ids}"
        got = [step[t] for step, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < ATOL, (req.adapter, got, lps)
    assert outputs[0].token_ids != outputs[1].token_ids or outputs[0].logprobs != outputs[1].logprobs


def test_patterns_are_served_as_peft_serves_them(engine, ckpt):
    """rank_pattern / alpha_pattern: one GenAI Adapter per scaling, each with its alpha, in one
    AdapterConfig; the rows match the PEFT oracle, which differs from the adapter without patterns."""
    engine.load_adapter("pattern", ckpt["pattern"])
    # one Adapter per distinct scaling: 2 (the rest), 4 (v_proj's 16 / 4 and layer 0 q_proj's 32 / 8), 16
    assert sorted(alpha for _, alpha in engine._adapters["pattern"][1]) == pytest.approx([2.0, 4.0, 16.0])
    for prompt in PROMPTS:
        out = engine.generate([GenerationRequest(prompt, adapter="pattern", max_new_tokens=6)])[0]
        _, ids, lps = oracle(ckpt["base"], ckpt["pattern"], prompt, 6)
        assert out.token_ids == ids, (prompt, out.token_ids, ids)
        got = [step[t] for step, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < ATOL, (prompt, got, lps)
    assert any(oracle(ckpt["base"], ckpt["pattern"], p, 6)[1] != _without_alpha_pattern(ckpt, p) for p in PROMPTS), \
        "test defect: alpha_pattern does not change the oracle's tokens"
    engine.unload_adapter("pattern")


def _without_alpha_pattern(ckpt, prompt):
    """The oracle's tokens for the pattern adapter read without its alpha_pattern (what an engine
    that ignores it gives; rank_pattern stays: it gives the tensors their shapes)."""
    import shutil

    plain = ckpt["root"] / "pattern-without-alpha-pattern"
    if not plain.exists():
        shutil.copytree(ckpt["pattern"], plain)
        cfg = json.loads((plain / "adapter_config.json").read_text())
        cfg["alpha_pattern"] = {}
        (plain / "adapter_config.json").write_text(json.dumps(cfg))
    return oracle(ckpt["base"], plain, prompt, 6)[1]


def test_reload_and_unload(engine, ckpt):
    engine.load_adapter("x", ckpt["a1"])
    first = engine.generate([GenerationRequest(PROMPTS[0], adapter="x", max_new_tokens=6)])[0]
    engine.load_adapter("x", ckpt["qv"])  # same name, new weights (a subset of bound modules: no rebuild)
    second = engine.generate([GenerationRequest(PROMPTS[0], adapter="x", max_new_tokens=6)])[0]
    _, ids, _ = oracle(ckpt["base"], ckpt["qv"], PROMPTS[0], 6)
    assert second.token_ids == ids, (second.token_ids, ids, first.token_ids)
    engine.unload_adapter("x")
    with pytest.raises(AdapterNotLoadedError):
        engine.generate([GenerationRequest(PROMPTS[0], adapter="x")])


def test_genai_skips_embed_tokens_lora_silently(engine, ckpt, tmp_path):
    """GenAI's own behaviour, the evidence behind the openvino expectations' embed_tokens entry: it
    accepts an adapter with embed_tokens LoRA and serves exactly what the same adapter without its
    ``lora_embedding_A/B`` tensors gives (its name patterns do not know them), not what PEFT serves."""
    from safetensors.torch import load_file, save_file

    engine.load_adapter("emb", ckpt["emb"])
    assert "emb" in engine.list_adapters()
    stripped = tmp_path / "emb-without-embedding-tensors"
    stripped.mkdir()
    cfg = json.loads((ckpt["emb"] / "adapter_config.json").read_text())
    cfg["target_modules"] = [m for m in cfg["target_modules"] if m != "embed_tokens"]
    (stripped / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ckpt["emb"] / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "lora_embedding" not in k},
              str(stripped / "adapter_model.safetensors"))
    out = engine.generate([GenerationRequest(PROMPTS[0], adapter="emb", max_new_tokens=6)])[0]
    _, with_embedding, _ = oracle(ckpt["base"], ckpt["emb"], PROMPTS[0], 6)
    _, without, lps = oracle(ckpt["base"], stripped, PROMPTS[0], 6)
    assert with_embedding != without, "suite defect: the embed_tokens LoRA does not change the oracle's tokens"
    assert out.token_ids == without, (out.token_ids, without, with_embedding)
    got = [step[t] for step, t in zip(out.logprobs, out.token_ids)]
    assert max(abs(a - b) for a, b in zip(got, lps)) < ATOL
    engine.unload_adapter("emb")


def test_prompt_top_k_is_refused(engine, ckpt):
    with pytest.raises(UnsupportedFeatureError, match="prompt top-k"):
        engine.generate([GenerationRequest(PROMPTS[0], prompt_logprobs=True)])


def test_unsupported_engine_args_refuse_the_start(ckpt):
    pytest.importorskip("openvino_genai")
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    with pytest.raises(UnsupportedFeatureError, match="max_loras_per_batch=2"):
        OpenVINOEngine(ckpt["base"], "cpu", "float32", {"max_loras_per_batch": "2"})


def test_one_token_requests_get_exact_top_k(engine, ckpt):
    """One beam step with k beams ranks the k best first tokens: each logprob equals the oracle's
    full-vocabulary log-softmax at that id."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine.load_adapter("k", ckpt["a1"])
    out = engine.generate([GenerationRequest(PROMPTS[2], adapter="k", max_new_tokens=1, top_k=5),
                           GenerationRequest(PROMPTS[2], adapter=None, max_new_tokens=1, top_k=5)])
    tok = AutoTokenizer.from_pretrained(str(ckpt["base"]))
    base = AutoModelForCausalLM.from_pretrained(str(ckpt["base"]), dtype=torch.float32).eval()
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        plain = torch.log_softmax(base(input_ids=ids).logits[0, -1], -1)
        adapted = torch.log_softmax(PeftModel.from_pretrained(base, str(ckpt["a1"])).eval()(input_ids=ids).logits[0, -1], -1)
    for res, row in ((out[0], adapted), (out[1], plain)):
        want = torch.topk(row, 5)
        assert list(res.logprobs[0]) == want.indices.tolist(), (res.logprobs[0], want)
        assert res.token_ids == [int(want.indices[0])]
        diffs = [abs(lp - float(row[t])) for t, lp in res.logprobs[0].items()]
        assert max(diffs) < ATOL, (res.logprobs[0], want)
    engine.unload_adapter("k")


def test_moe_base_and_attention_lora_match_the_oracle_and_expert_lora_reaches_genai(ckpt, tmp_path):
    """Mixtral converted (its experts as the checkpoint holds them, routed top-2): the base and an
    attention adapter match the PEFT oracle. An expert adapter (PEFT target_parameters on the fused
    3-D experts) goes to GenAI as the file holds it; GenAI binds a LoRA A/B pair to every MatMul whose
    name holds the module path, so its one expert-stacked pair for ``mlp.experts`` meets MatMuls of
    other shapes: it warns of unused tensors and fails when serving (ParameterMismatch), the evidence
    behind the moe entries of the openvino expectations."""
    pytest.importorskip("openvino_genai")
    from lora_conformance.engines.openvino_engine import OpenVINOEngine
    from lora_conformance.engines.base import EngineFailure

    moe = build_moe(tmp_path / "moe")
    attn = build_adapter(moe, tmp_path / "attn", seed=7, target_modules=["q_proj", "v_proj"])
    experts = build_adapter(moe, tmp_path / "experts", seed=8, target_modules=[],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    eng = OpenVINOEngine(moe, "cpu", "float32", {"ir_cache": str(tmp_path / "ir")})
    try:
        assert Capability.MOE in eng.capabilities
        eng.load_adapter("attn", attn)
        for name, adapter in ((None, None), ("attn", attn)):
            out = eng.generate([GenerationRequest(PROMPTS[0], adapter=name, max_new_tokens=6)])[0]
            prompt_ids, ids, lps = oracle(moe, adapter, PROMPTS[0], 6)
            assert out.token_ids == ids, (name, out.token_ids, ids)
            got = [step[t] for step, t in zip(out.logprobs, out.token_ids)]
            assert max(abs(a - b) for a, b in zip(got, lps)) < ATOL, (name, got, lps)
        eng.load_adapter("experts", experts)  # not refused by the plugin: GenAI gets it
        with pytest.raises(EngineFailure, match="ParameterMismatch"):
            eng.generate([GenerationRequest(PROMPTS[0], adapter="experts", max_new_tokens=2)])
    finally:
        eng.close()
