"""The built-in engine against HF transformers + PEFT: single adapters, mixed batches, LoRA
variants (rsLoRA, patterns, embed_tokens, lm_head), architectures (Qwen2/3, Mistral, MoE)
and encoder embeddings. CPU, float32 (tight) and bfloat16 (loose)."""

from __future__ import annotations

import warnings

import pytest
import torch

from _builtin_models import build_adapter, build_bert, build_decoder
from _builtin_reference import (LOGPROB_ATOL, max_topk_error, peft_model, reference_generate,
                                reference_prompt_logprobs)
from lora_conformance.engines.base import Capability
from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.types import GenerationRequest

PROMPTS = ["the cat sat on the mat", "a dog ran fast", "one two three four five six seven eight nine ten and",
           "red blue green"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("builtin_llama")
    base = build_decoder(d / "base")
    ads = {"a1": build_adapter(base, d / "a1", 1), "a2": build_adapter(base, d / "a2", 2, r=4, alpha=8)}
    return base, ads


def _tok(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base))


def check_against_reference(engine, base, adapters, names, dtype, max_new=5, prompts=PROMPTS):
    """Engine greedy tokens == PEFT's, top-k logprobs within the dtype's tolerance."""
    prompts = (prompts * len(names))[: len(names)]
    reqs = [GenerationRequest(p, n, max_new_tokens=max_new, top_k=3) for p, n in zip(prompts, names)]
    res = engine.generate(reqs)
    model = peft_model(base, adapters, dtype)
    # PEFT cannot route target_parameters per row: a batch of one adapter needs no routing.
    single = len(set(names)) == 1 and names[0] is not None
    peft_names = [n or "__base__" for n in names] if adapters and not single else None
    if single:
        model.set_adapter(names[0])  # else PEFT serves its first loaded adapter
    toks, lps = reference_generate(model, _tok(base), prompts, peft_names, max_new)
    for i, r in enumerate(res):
        if dtype == "float32":
            assert r.token_ids == toks[i], f"request {i} ({names[i]}): engine {r.token_ids} != PEFT {toks[i]}"
        else:
            assert r.token_ids[0] == toks[i][0], f"request {i}: first token {r.token_ids[0]} != {toks[i][0]}"
        steps = len(r.logprobs) if dtype == "float32" else 1
        for s in range(steps):
            err = max_topk_error(r.logprobs[s], lps[i][s])
            assert err <= LOGPROB_ATOL[dtype], f"request {i} step {s}: logprob error {err:.2e}"
    return res


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_adapter_matches_peft(llama, dtype):
    base, ads = llama
    with BuiltinEngine(base, "cpu", dtype, {}) as eng:
        eng.load_adapter("a1", ads["a1"])
        check_against_reference(eng, base, {"a1": ads["a1"]}, ["a1", "a1"], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_matches_peft(llama, dtype):
    base, ads = llama
    with BuiltinEngine(base, "cpu", dtype, {}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        res = check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", None], dtype)
        # the three kinds of rows really differ: routing is not a no-op
        assert len({tuple(r.token_ids) for r in res[:3]}) == 3


def test_prompt_logprobs_match_peft(llama):
    base, ads = llama
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.load_adapter("a2", ads["a2"])
        reqs = [GenerationRequest(PROMPTS[2], a, max_new_tokens=1, top_k=4, prompt_logprobs=True) for a in ("a2", None)]
        res = eng.generate(reqs)
    model = peft_model(base, {"a2": ads["a2"]})
    for r, a in zip(res, ("a2", None)):
        ref = reference_prompt_logprobs(model, _tok(base), PROMPTS[2], a)
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(r.prompt_token_ids) - 1
        for i, row in enumerate(r.prompt_logprobs):
            assert len(row) == 4
            assert max_topk_error(row, ref[i]) < 1e-4, f"position {i + 1}"
            assert max(row, key=row.get) == int(ref[i].argmax())


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen3", False),
                                       pytest.param("mistral", False, marks=pytest.mark.slow), ("llama", True)])
def test_architectures_match_peft(tmp_path, arch, tie):
    base = build_decoder(tmp_path / "base", arch=arch, tie=tie, seed=3)
    ad = build_adapter(base, tmp_path / "ad", 5)
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.load_adapter("ad", ad)
        check_against_reference(eng, base, {"ad": ad}, ["ad", None], "float32")


@pytest.mark.parametrize("variant", ["rslora", "patterns", "embed_lm_head", "layers_to_transform"])
def test_lora_variants_match_peft(llama, tmp_path, variant):
    base, _ = llama
    kw = {
        "rslora": dict(r=16, alpha=8, use_rslora=True),
        "patterns": dict(r=8, alpha=16, use_rslora=True, rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 2},
                         alpha_pattern={"v_proj": 64, r"model\.layers\.0\.self_attn\.o_proj": 3}),
        "embed_lm_head": dict(r=4, alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]),
        "layers_to_transform": dict(r=4, alpha=8, layers_to_transform=[1], target_modules=["q_proj", "v_proj"]),
    }[variant]
    ad = build_adapter(base, tmp_path / "ad", 7, **kw)
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.load_adapter("v", ad)
        check_against_reference(eng, base, {"v": ad}, ["v", None], "float32")
        if variant == "embed_lm_head":  # lm_head LoRA must reach the prompt logprobs too
            r = eng.generate([GenerationRequest(PROMPTS[0], "v", max_new_tokens=1, prompt_logprobs=True)])[0]
            ref = reference_prompt_logprobs(peft_model(base, {"v": ad}), _tok(base), PROMPTS[0], "v")
            assert max(max_topk_error(row, ref[i]) for i, row in enumerate(r.prompt_logprobs)) < 1e-4


@pytest.mark.parametrize("arch", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_moe_expert_lora_matches_peft(tmp_path, arch):
    base = build_decoder(tmp_path / "base", arch=arch, seed=4)
    targets = ["q_proj", "v_proj"] + (["shared_expert.gate_proj"] if arch == "qwen2_moe" else [])
    ad = build_adapter(base, tmp_path / "ad", 6, r=4, alpha=8, target_modules=targets,
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        assert eng.supports(Capability.MOE)
        eng.load_adapter("moe", ad)
        # PEFT does no mixed batches with target_parameters: one reference run per adapter.
        check_against_reference(eng, base, {"moe": ad}, ["moe", "moe"], "float32")
        check_against_reference(eng, base, {}, [None, None], "float32")


def test_encoder_embeddings_match_hf_mean_pooling(tmp_path):
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    base = build_bert(tmp_path / "bert")
    ad = build_adapter(base, tmp_path / "ad", 3, encoder=True)
    texts = ["the cat sat", "a dog ran fast on the mat", "red"]
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True)

    def hf(model):
        with torch.no_grad():
            h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        assert eng.supports("embeddings") and eng.supports("mixed_batch")
        eng.load_adapter("ad", ad)
        got_base = torch.tensor(eng.embed(texts))
        got_ad = torch.tensor(eng.embed(texts, adapter="ad"))
        got_mixed = torch.tensor(eng.embed(texts, adapter=["ad", None, "ad"]))  # one adapter per text
        with pytest.raises(ValueError, match="2 adapters for 3 texts"):
            eng.embed(texts, adapter=["ad", None])
    ref_base = hf(AutoModel.from_pretrained(str(base)).eval())
    ref_ad = hf(PeftModel.from_pretrained(AutoModel.from_pretrained(str(base)), str(ad)).eval())
    torch.testing.assert_close(got_base, ref_base, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ad, ref_ad, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_mixed, torch.stack([ref_ad[0], ref_base[1], ref_ad[2]]), atol=1e-5, rtol=0)
    assert (got_base - got_ad).abs().max() > 1e-3
    torch.testing.assert_close(got_base.norm(dim=-1), torch.ones(3))


def test_mixed_embedding_batch_with_more_adapters_than_slots(tmp_path):
    """Per-text adapters beyond max_loras_per_batch: the batch is split, every text keeps its adapter."""
    base = build_bert(tmp_path / "bert")
    ads = {n: build_adapter(base, tmp_path / n, seed, encoder=True) for n, seed in (("e1", 3), ("e2", 4))}
    texts = ["the cat sat", "a dog ran fast on the mat", "red", "the sun"]
    names = ["e1", "e2", None, "e1"]
    with BuiltinEngine(base, "cpu", "float32", {"max_loras_per_batch": "1", "max_loaded_loras": "2"}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        mixed = eng.embed(texts, names)
        alone = [eng.embed([t], n)[0] for t, n in zip(texts, names)]
        first_with_e2 = eng.embed(texts[:1], "e2")[0]
    torch.testing.assert_close(torch.tensor(mixed), torch.tensor(alone), atol=1e-5, rtol=0)
    # the test's power: a text under the other adapter gives another embedding
    assert (torch.tensor(mixed[0]) - torch.tensor(first_with_e2)).abs().max() > 1e-3


def test_masked_prefill_matches_peft(llama):
    """Accelerators prefill with the masked (all-slot) LoRA path; cpu defaults to segments. Both must agree."""
    base, ads = llama
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        eng.runner.segmented_prefill = False
        for n, p in ads.items():
            eng.load_adapter(n, p)
        check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", None], "float32")


def test_decode_step_is_graph_capturable(llama):
    """What graphs capture (one decode step) never syncs with the host and allocates no data-dependent shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.item.default, torch.ops.aten.bincount.default}

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bad, self.calls = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            if func in syncing:
                self.bad.append(str(func))
            return func(*args, **(kwargs or {}))

    base, ads = llama
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        watch, forward = Watch(), eng.runner.decode_forward

        def watched(*a, **kw):
            with watch:
                return forward(*a, **kw)

        eng.runner.decode_forward = watched
        eng.generate([GenerationRequest(p, n, max_new_tokens=3) for p, n in zip(PROMPTS, ["a1", None, "a2", "a1"])])
    assert watch.calls > 0 and watch.bad == [], watch.bad


def test_compiled_decode_matches_peft_at_two_batch_sizes(llama):
    """exec_mode=compile (torch.compile of the decode step, inductor's cpu backend here) on mixed
    batches of two bucket sizes, so the compiled step is re-entered with other shapes: the tokens
    and logprobs of PEFT. Its inputs are one flat buffer sliced inside the compiled region (six
    aliased views of it failed in AOT autograd under dynamic shapes on an H200)."""
    base, ads = llama
    with BuiltinEngine(base, "cpu", "float32", {"exec_mode": "compile"}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        check_against_reference(eng, base, ads, ["a1", None, "a2"], "float32", max_new=4)
        check_against_reference(eng, base, ads, ["a2", "a1", None, "a1", "a2"], "float32", max_new=4)


@pytest.mark.parametrize("forced_break", [False, True], ids=["whole", "forced-break"])
def test_compiled_decode_on_the_accelerator_layout_compiles_once(llama, monkeypatch, forced_break):
    """exec_mode=compile on the layout accelerators use (o_proj / down_proj with the expand under the
    base weight, the attention output and act(gate) * up written into their input buffers): the decode
    step compiles without a graph break and gives PEFT's tokens and logprobs. Each ``out=`` into a
    buffer's view was a graph break, and the frame resumed after it took aliased buffers as inputs,
    which inductor could not compile (13 cases of the H200's compile-mode certification).
    One graph serves batches of 8, 3, 12, 1 and 2 rows: a row count in a buffer cache's key, and a
    one-row bucket, each compiled the whole decoder again (four compiles of the 28-layer base took
    the H200's full-profile compile case 460 s).
    forced-break: where the step does break its graph (on an H100, torch 2.11, it broke inside the LoRA
    routing; the break is forced at the same place), the engine says so (a RuntimeWarning naming the
    break), compiles the step in pieces, and every bucket still gives PEFT's outputs. The pieces may
    compile again for new buckets (graph_runner.DecodeGraphs._compiled_step: what avoids that costs
    more than it saves on a deep decoder), so only the whole step is held to one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lora_conformance.engines.builtin.engine import model_runner
    from lora_conformance.engines.builtin.layers import attention
    from test_builtin_fast_paths import _accelerator_layout

    if forced_break:
        real = model_runner.ModelRunner.lora_batch

        def broken(self, *args, **kwargs):
            torch._dynamo.graph_break()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(model_runner.ModelRunner, "lora_batch", broken)
    monkeypatch.setattr(attention, "DECODE_OUT_ALWAYS", True)  # cuda's attention writes into the buffer
    base, ads = llama
    torch._dynamo.reset()
    counters.clear()
    with BuiltinEngine(base, "cpu", "float32", {"exec_mode": "compile"}) as eng:
        _accelerator_layout(eng)
        for n, p in ads.items():
            eng.load_adapter(n, p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", "a2", None, "a1", "a2"], "float32",
                                    max_new=3)
        said = [str(w.message) for w in caught if "does not compile as one graph" in str(w.message)]
        first = dict(counters["stats"])
        for names in (["a2", "a1", None], ["a1", None, "a2"] * 4, ["a2"], [None, "a1"]):  # buckets 4, 16, 2, 2
            check_against_reference(eng, base, ads, names, "float32", max_new=3)
        layer = eng.model.model.layers[0]
        assert layer.self_attn.o_proj.group.cat and layer.mlp.down_proj.group.cat
        graph_break = eng.runner.graphs.graph_break
    if forced_break:
        assert counters["graph_break"] and first["unique_graphs"] > 1  # the forced break split the step
        assert graph_break and "graph_break" in graph_break, graph_break  # and the engine says where
        assert len(said) == 1 and graph_break in said[0], said
    else:
        assert graph_break is None and not said, (graph_break, said)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert first["unique_graphs"] == 1, first
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_lora_batch_field_defaults_are_plain_values():
    """dynamo (torch 2.11, as on the GPU machines) cannot trace a dataclass __init__ whose field
    defaults hold an object: ``experts: ExpertLora = ExpertLora()`` broke the compiled decode step's
    graph at every LoraBatch it built (torch 2.13, here, traces it, so the compile test above
    does not show it)."""
    import dataclasses

    from lora_conformance.engines.builtin.layers.lora import LoraBatch

    for f in dataclasses.fields(LoraBatch):
        if f.default is not dataclasses.MISSING:
            assert f.default is None or isinstance(f.default, (bool, int, float, str)), (f.name, f.default)
