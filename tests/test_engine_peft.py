"""The peft engine against an independent oracle: a plain single-adapter PeftModel, one
unpadded prompt at a time, greedy by full forwards (no KV cache, no generate())."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_adapter, build_bert, build_llama, build_moe  # noqa: E402

from lora_conformance.engines.base import (  # noqa: E402
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    EngineError,
    UnsupportedFeatureError,
)
from lora_conformance.engines.peft_engine import PeftEngine  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402

ATOL = 2e-5  # float32 logprobs; padding changes matmul shapes, not the math
PROMPTS = ["the cat sat on the mat", "a dog", "one two three four five six seven"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_engine")
    base = build_llama(root / "llama")
    return {
        "root": root,
        "base": base,
        "a1": build_adapter(base, root / "a1", seed=1),
        "a2": build_adapter(base, root / "a2", seed=2, r=4, alpha=8, use_rslora=True,
                            rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3}),
        "emb": build_adapter(base, root / "emb", seed=3, target_modules=["embed_tokens", "lm_head", "v_proj"]),
        "mts": build_adapter(base, root / "mts", seed=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "dora": build_adapter(base, root / "dora", seed=5, target_modules=["q_proj", "v_proj"], use_dora=True),
        "big": build_adapter(base, root / "big", seed=6, r=300, target_modules=["q_proj"]),
        "bias": build_adapter(base, root / "bias", seed=10, target_modules=["q_proj", "down_proj"], lora_bias=True),
    }


@pytest.fixture(scope="module")
def engine(ckpt):
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    for name in ("a1", "a2", "emb", "bias"):
        e.load_adapter(name, ckpt[name])
    yield e
    e.close()


@pytest.fixture(scope="module")
def mts_engine(ckpt):
    # PEFT cannot hold a modules_to_save copy of lm_head beside a LoRA on lm_head ("emb").
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    for name in ("a1", "mts"):
        e.load_adapter(name, ckpt[name])
    yield e
    e.close()


def oracle(ckpt, adapter, prompt, steps, k=5):
    """(token ids, per-step top-k, prompt top-k) from a fresh single-adapter PeftModel."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt["base"]))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt["base"]), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(ckpt[adapter])).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out, tops = [], []
    with torch.no_grad():
        prompt_lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1]
        for _ in range(steps):
            lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
            nxt = int(lp.argmax())
            out.append(nxt)
            tops.append(lp)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out, tops, prompt_lp


def assert_topk_matches(got: dict, full_lp, k: int, where: str):
    assert len(got) == k, f"{where}: {len(got)} entries, expected {k}"
    want = torch.topk(full_lp, k).indices.tolist()
    assert sorted(got) == sorted(want), f"{where}: top-{k} ids {sorted(got)} != oracle {sorted(want)}"
    for tid, lp in got.items():
        assert math.isclose(lp, float(full_lp[tid]), abs_tol=ATOL), f"{where}: token {tid}: {lp} vs {float(full_lp[tid])}"


def test_declares_truthful_capabilities(engine):
    caps = engine.capabilities
    for c in (Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.RANK_PATTERN,
              Capability.EMBED_TOKENS, Capability.LM_HEAD, Capability.PROMPT_LOGPROBS, Capability.MODULES_TO_SAVE):
        assert c in caps, c
    for c in (Capability.DORA, Capability.EMBEDDINGS, Capability.PREFIX_CACHE, Capability.GRAPHS):
        assert c not in caps, c
    assert engine.limits.max_rank == 256 and engine.limits.max_loras_per_batch >= 8


@pytest.mark.parametrize("adapters", [
    [None, "a1", "a2"],  # base row beside two adapters
    ["emb", None, "a1"],  # embedding + lm_head LoRA
    ["a2", "a2", "a1"],
    ["bias", "a1", None],  # lora_bias: B carries a bias, scaled with the delta
    ["mts", None, "a1"],  # modules_to_save (a full lm_head copy) routed per row
])
def test_mixed_batch_matches_single_adapter_oracle(ckpt, engine, mts_engine, adapters):
    engine = mts_engine if "mts" in adapters else engine
    reqs = [GenerationRequest(p, a, max_new_tokens=6, top_k=4, prompt_logprobs=True) for p, a in zip(PROMPTS, adapters)]
    results = engine.generate(reqs)
    assert len(results) == len(reqs)
    for i, (req, res) in enumerate(zip(reqs, results)):
        want_ids, want_tops, want_prompt = oracle(ckpt, req.adapter, req.prompt, 6)
        where = f"row {i} adapter={req.adapter}"
        assert res.token_ids == want_ids, f"{where}: {res.token_ids} != oracle {want_ids}"
        for s, (got, lp) in enumerate(zip(res.logprobs, want_tops)):
            assert_topk_matches(got, lp, 4, f"{where} step {s}")
        assert res.prompt_token_ids[0] == engine.tokenizer.bos_token_id
        assert len(res.prompt_logprobs) == len(res.prompt_token_ids) - 1
        for p, (got, lp) in enumerate(zip(res.prompt_logprobs, want_prompt)):
            assert_topk_matches(got, lp, 4, f"{where} prompt position {p}")
        assert res.text == engine.tokenizer.decode(want_ids, skip_special_tokens=True)


def test_adapters_change_outputs(engine):
    """Guards the oracle comparison against adapters that happen to be no-ops."""
    names = (None, "a1", "a2", "emb", "bias")
    outs = engine.generate([GenerationRequest(PROMPTS[0], a, max_new_tokens=6) for a in names])
    assert len({tuple(r.token_ids) for r in outs}) == len(names), [r.token_ids for r in outs]


def test_padding_keeps_rows_close_to_unpadded(engine):
    """Left padding with masked positions: batched rows match the same rows served alone."""
    reqs = [GenerationRequest(p, a, max_new_tokens=8, top_k=5) for p, a in zip(PROMPTS, ["a1", None, "a2"])]
    batched = engine.generate(reqs)
    worst = 0.0
    for req, b in zip(reqs, batched):
        alone = engine.generate([req])[0]
        assert alone.token_ids == b.token_ids
        for x, y in zip(alone.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            worst = max(worst, *(abs(x[t] - y[t]) for t in x))
    assert worst < ATOL, f"padded vs unpadded logprobs differ by {worst}"


def test_ignore_eos_false_stops_after_eos(engine):
    full = engine.generate([GenerationRequest(PROMPTS[1], None, max_new_tokens=8)])[0]
    stop_at = full.token_ids[2]
    old = engine.tokenizer.eos_token
    engine.tokenizer.eos_token = engine.tokenizer.convert_ids_to_tokens(stop_at)
    try:
        cut = engine.generate([GenerationRequest(PROMPTS[1], None, max_new_tokens=8, ignore_eos=False)])[0]
    finally:
        engine.tokenizer.eos_token = old
    first = full.token_ids.index(stop_at)
    assert cut.token_ids == full.token_ids[: first + 1]
    assert len(cut.logprobs) == first + 1


def test_per_request_lengths_and_topk(engine):
    res = engine.generate([GenerationRequest(PROMPTS[0], "a1", max_new_tokens=3, top_k=2),
                           GenerationRequest(PROMPTS[1], None, max_new_tokens=7, top_k=6)])
    assert [len(r.token_ids) for r in res] == [3, 7]
    assert {len(t) for t in res[0].logprobs} == {2} and {len(t) for t in res[1].logprobs} == {6}
    assert all(r.prompt_logprobs is None for r in res)
    assert engine.generate([]) == []


def test_reload_same_name_uses_new_weights(ckpt):
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    req = [GenerationRequest(PROMPTS[2], "x", max_new_tokens=6)]
    e.load_adapter("x", ckpt["a1"])
    first = e.generate(req)[0].token_ids
    e.load_adapter("x", ckpt["a2"])  # replace in place
    assert e.generate(req)[0].token_ids == oracle(ckpt, "a2", PROMPTS[2], 6)[0] != first
    e.unload_adapter("x")
    assert e.list_adapters() == []
    with pytest.raises(AdapterNotLoadedError):
        e.generate(req)
    with pytest.raises(AdapterNotLoadedError):
        e.unload_adapter("x")
    # After the last adapter is gone the engine serves the plain base, then accepts new ones.
    base = e.generate([GenerationRequest(PROMPTS[2], None, max_new_tokens=6)])[0].token_ids
    assert base == oracle(ckpt, None, PROMPTS[2], 6)[0]
    e.load_adapter("x", ckpt["a1"])
    assert e.generate(req)[0].token_ids == first


def test_single_letter_names_do_not_confuse_the_missing_key_check(ckpt):
    """PEFT's own missing-key filter is a substring test: "B" matches "lora_B.A.weight"."""
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    e.load_adapter("A", ckpt["a1"])
    e.load_adapter("B", ckpt["a2"])
    res = e.generate([GenerationRequest(PROMPTS[0], n, max_new_tokens=4) for n in ("A", "B")])
    assert [r.token_ids for r in res] == [oracle(ckpt, a, PROMPTS[0], 4)[0] for a in ("a1", "a2")]


def test_dora_single_adapter_batches_only(ckpt):
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    e.load_adapter("a1", ckpt["a1"])
    e.load_adapter("dora", ckpt["dora"])
    res = e.generate([GenerationRequest(PROMPTS[0], "dora", max_new_tokens=5)] * 2)
    assert res[0].token_ids == res[1].token_ids == oracle(ckpt, "dora", PROMPTS[0], 5)[0]
    with pytest.raises(UnsupportedFeatureError, match="dora"):
        e.generate([GenerationRequest(PROMPTS[0], "dora"), GenerationRequest(PROMPTS[0], None)])
    # a mixed batch not touching the DoRA adapter still works
    mixed = e.generate([GenerationRequest(PROMPTS[0], "a1", max_new_tokens=5), GenerationRequest(PROMPTS[0], None, max_new_tokens=5)])
    assert mixed[0].token_ids == oracle(ckpt, "a1", PROMPTS[0], 5)[0]


def test_conflicting_adapters_are_refused_cleanly(ckpt, mts_engine):
    with pytest.raises(AdapterIncompatibleError, match="modules_to_save"):
        mts_engine.load_adapter("emb", ckpt["emb"])
    assert mts_engine.list_adapters() == ["a1", "mts"]
    res = mts_engine.generate([GenerationRequest(PROMPTS[0], "a1", max_new_tokens=4)])[0]
    assert res.token_ids == oracle(ckpt, "a1", PROMPTS[0], 4)[0]


def test_moe_target_parameters_single_adapter_batches_only(tmp_path):
    base = build_moe(tmp_path / "moe")
    experts = build_adapter(base, tmp_path / "experts", seed=8, r=4, target_modules=[],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    attn = build_adapter(base, tmp_path / "attn", seed=9, target_modules=["q_proj", "v_proj"])
    ck = {"base": base, "experts": experts, "attn": attn}
    e = PeftEngine(base, "cpu", "float32", {})
    e.load_adapter("experts", experts)
    e.load_adapter("attn", attn)
    for adapter in ("experts", None):
        res = e.generate([GenerationRequest(PROMPTS[0], adapter, max_new_tokens=5)] * 2)
        assert res[0].token_ids == res[1].token_ids == oracle(ck, adapter, PROMPTS[0], 5)[0], adapter
    # PEFT's parameter wrappers refuse adapter_names, even for rows that do not use them.
    for batch in (["experts", None], ["attn", None]):
        with pytest.raises(UnsupportedFeatureError, match="experts"):
            e.generate([GenerationRequest(PROMPTS[0], a) for a in batch])
    e.unload_adapter("experts")
    mixed = e.generate([GenerationRequest(PROMPTS[0], a, max_new_tokens=5) for a in ("attn", None)])
    assert mixed[0].token_ids == oracle(ck, "attn", PROMPTS[0], 5)[0]


def test_rejections(ckpt, tmp_path):
    with pytest.raises(EngineError, match="unknown engine argument"):
        PeftEngine(ckpt["base"], "cpu", "float32", {"bogus": "1"})
    e = PeftEngine(ckpt["base"], "cpu", "float32", {})
    with pytest.raises(AdapterIncompatibleError, match="rank 300"):
        e.load_adapter("big", ckpt["big"])
    with pytest.raises(AdapterIncompatibleError, match="adapter_config.json"):
        e.load_adapter("none", tmp_path)
    with pytest.raises(UnsupportedFeatureError):
        e.embed(["the cat"])
    assert e.list_adapters() == []
    assert e.generate([GenerationRequest("a dog", None, 4)])[0].token_ids == oracle(ckpt, None, "a dog", 4)[0]


def test_encoder_embeddings(tmp_path):
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    base = build_bert(tmp_path / "bert")
    ad = build_adapter(base, tmp_path / "enc", seed=7, model_cls="encoder")
    e = PeftEngine(base, "cpu", "float32", {})
    assert Capability.EMBEDDINGS in e.capabilities and Capability.MIXED_BATCH not in e.capabilities
    e.load_adapter("enc", ad)
    texts = ["the cat sat on the mat", "a dog"]
    tok = AutoTokenizer.from_pretrained(str(base))
    for adapter in (None, "enc"):
        got = torch.tensor(e.embed(texts, adapter))
        model = AutoModel.from_pretrained(str(base)).eval()
        if adapter:
            model = PeftModel.from_pretrained(model, str(ad)).eval()
        for i, t in enumerate(texts):  # unpadded, one at a time
            with torch.no_grad():
                h = model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0)
            want = h / h.norm()
            assert torch.allclose(got[i], want, atol=1e-5), (adapter, i, (got[i] - want).abs().max())
    assert not torch.allclose(torch.tensor(e.embed(texts)), torch.tensor(e.embed(texts, "enc")), atol=1e-3)
    with pytest.raises(UnsupportedFeatureError):
        e.generate([GenerationRequest("a dog")])


def test_the_output_head_reads_its_input_contiguous(ckpt):
    """generate() hands the head the prompts' last position as a strided view; torch's cpu matmul in
    float16/bfloat16 with a frozen weight takes a slow path on one (24 s instead of 0.05 s at a real
    vocabulary), which made the engine unusable at real shapes. The engine gives the head the same
    values, contiguous."""
    e = PeftEngine(ckpt["base"], "cpu", "bfloat16", {})
    try:
        e.load_adapter("a1", ckpt["a1"])
        head = e._base.get_output_embeddings()
        seen = []
        forward = head.forward

        def recording(x, *args, **kwargs):
            seen.append((tuple(x.shape), x.is_contiguous()))
            return forward(x, *args, **kwargs)

        head.forward = recording
        e.generate([GenerationRequest(p, a, 2) for p in PROMPTS[:2] for a in ("a1", None)])
        assert any(shape[0] > 1 for shape, _ in seen), seen  # batched rows, where a slice would be strided
        assert all(contiguous for _, contiguous in seen), seen
    finally:
        e.close()
