"""Benign variations of the built-in engine (``variant=``, the negative controls): each is a
correct engine (float32 outputs within 1e-4 logprob of the default), each really changes the
computation (an observable of its own), and malformed values are refused clearly."""

from __future__ import annotations

import pytest
import torch

from _builtin_models import build_adapter, build_bert, build_decoder
from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.engines.builtin.args import EngineArgs
from lora_conformance.engines.builtin.variants import (DEVICE_CONTROLS, NEGATIVE_CONTROLS, VARIANTS, Variant,
                                                       negative_controls)
from lora_conformance.types import GenerationRequest

PROMPTS = ["the cat sat on the mat and the dog ran fast", "one two three four five six seven",
           "the sun and the moon and the big red tree", "a small blue sea"]
LABELS = ["a1", None, "a2", "a1"]
# rescale by factors that are not powers of two (those only move exponents: bit-identical)
VARIANT_ARGS = ["rescale:3", "rescale:0.3", "preround", "svd", "reverse", "one_at_a_time", "fp32_delta"]
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("builtin_variants")
    base = build_decoder(d / "base", seed=3)
    bert = build_bert(d / "bert", seed=3)
    return {"base": base, "bert": bert,
            # scaling 6/4 = 1.5: not a power of two, so folding it into a pre-rounded B rounds again
            "a1": build_adapter(base, d / "a1", 11, r=4, alpha=6),
            "a2": build_adapter(base, d / "a2", 12, r=8, alpha=16),
            "e1": build_adapter(bert, d / "e1", 13, encoder=True),
            "e2": build_adapter(bert, d / "e2", 14, encoder=True)}


def run(world, dtype, args):
    with BuiltinEngine(world["base"], "cpu", dtype, args) as eng:
        for n in ("a1", "a2"):
            eng.load_adapter(n, world[n])
        reqs = [GenerationRequest(p, a, max_new_tokens=4, top_k=5, prompt_logprobs=True)
                for p, a in zip(PROMPTS, LABELS)]
        outs = eng.generate(reqs)
    with BuiltinEngine(world["bert"], "cpu", dtype, args) as eng:
        for n in ("e1", "e2"):
            eng.load_adapter(n, world[n])
        vecs = eng.embed(PROMPTS, ["e1", "e2", None, "e1"])
    return outs, vecs


def max_logprob_gap(a, b) -> float:
    """Largest |Δ logprob| over every step's and prompt position's top-k (token sets must agree)."""
    worst = 0.0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids, f"tokens {x.token_ids} vs {y.token_ids}"
        for px, py in zip(x.logprobs + (x.prompt_logprobs or []), y.logprobs + (y.prompt_logprobs or [])):
            assert px.keys() == py.keys(), f"top-k token sets differ: {sorted(px)} vs {sorted(py)}"
            worst = max(worst, max(abs(px[t] - py[t]) for t in px))
    return worst


@pytest.fixture(scope="module")
def default_f32(world):
    return run(world, "float32", {})


@pytest.mark.parametrize("variant", VARIANT_ARGS)
def test_variant_equals_default_in_float32(world, default_f32, variant):
    outs, vecs = run(world, "float32", {"variant": variant})
    ref_outs, ref_vecs = default_f32
    gap = max_logprob_gap(outs, ref_outs)
    assert gap <= LOGPROB_ATOL, f"variant {variant}: max |Δ logprob| {gap:.3g} vs the default, expected <= {LOGPROB_ATOL}"
    vgap = (torch.tensor(vecs) - torch.tensor(ref_vecs)).abs().max().item()
    assert vgap <= LOGPROB_ATOL, f"variant {variant}: embeddings differ by {vgap:.3g}, expected <= {LOGPROB_ATOL}"


def test_rescale_is_a_real_variation_in_bfloat16(world):
    (default, dvec), (rescaled, rvec) = run(world, "bfloat16", {}), run(world, "bfloat16", {"variant": "rescale:3"})
    same = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs
               for a, b in zip(default, rescaled))
    assert not same, "rescale:3 gave bit-identical bfloat16 logprobs: the variant changes nothing"
    assert dvec != rvec, "rescale:3 gave bit-identical bfloat16 embeddings"


def _packed(eng, name):
    ad = eng.pool.host_adapter(name)
    return {k: (m.A.clone(), m.Bt.clone()) for k, m in ad.modules.items()}


@pytest.mark.parametrize("variant", ["rescale:3", "preround", "svd", "reverse", "one_at_a_time", "fp32_delta"])
def test_variant_changes_its_own_observable(world, variant, monkeypatch):
    """Each variant's mechanism, seen directly (the outputs may legitimately agree)."""
    with BuiltinEngine(world["base"], "cpu", "bfloat16", {}) as plain, \
            BuiltinEngine(world["base"], "cpu", "bfloat16", {"variant": variant}) as eng:
        for e in (plain, eng):
            for n in ("a1", "a2"):
                e.load_adapter(n, world[n])
        if variant in ("rescale:3", "preround", "svd"):
            a, b = _packed(plain, "a1"), _packed(eng, "a1")
            assert any(not torch.equal(a[k][i], b[k][i]) for k in a for i in (0, 1)), f"{variant}: packed weights unchanged"
            return
        if variant == "fp32_delta":
            assert (plain.runner.delta_dtype, eng.runner.delta_dtype) == (None, torch.float32)
            return
        orders = []  # the sequences each prefill receives, in admission order: (request's adapter, prompt)

        def spy(runner):
            original = runner.prefill
            monkeypatch.setattr(runner, "prefill", lambda seqs: (
                orders.append([(s.adapter, PROMPTS.index(PROMPT_OF[tuple(s.prompt_ids)])) for s in seqs]),
                original(seqs))[1])

        PROMPT_OF = {tuple(eng.tokenizer(p)["input_ids"]): p for p in PROMPTS}
        spy(eng.runner)
        reqs = [GenerationRequest(p, a, max_new_tokens=2) for p, a in zip(PROMPTS, LABELS)]
        eng.generate(reqs)
        if variant == "one_at_a_time":
            assert orders == [[(a, i)] for i, a in enumerate(LABELS)], f"one_at_a_time prefilled {orders}"
        else:  # reverse: one batch, admitted in the default engine's order reversed
            spy(plain.runner)
            plain.generate(reqs)
            assert len(orders) == 2 and orders[0] == orders[1][::-1], f"reverse {orders[0]} vs default {orders[1]}"


@pytest.mark.parametrize("value, message", [
    ("rescale:0", "positive finite factor"), ("rescale:-2", "positive finite factor"),
    ("rescale:x", "positive finite factor"), ("rescale", "positive finite factor"),
    ("rescale:inf", "positive finite factor"), ("nope", "unknown variant"), ("reverse:2", "unknown variant"),
])
def test_malformed_variant_is_refused(world, value, message):
    with pytest.raises(ValueError, match=message) as exc:
        EngineArgs.parse({"variant": value})
    assert f"variant={value!r}" in str(exc.value)
    if message == "unknown variant":  # the error lists what exists
        assert all(name in str(exc.value) for name in VARIANTS)
    with pytest.raises(ValueError, match=message):
        BuiltinEngine(world["base"], "cpu", "float32", {"variant": value})


def test_variant_parse_and_catalogue():
    assert Variant.parse(None) == Variant() and Variant.parse("") == Variant() and str(Variant()) == "default"
    assert Variant.parse("rescale:3") == Variant("rescale", 3.0) and str(Variant.parse("rescale:0.3")) == "rescale:0.3"
    assert {Variant.parse(v).name for v in VARIANT_ARGS} == {k.split(":")[0] for k in VARIANTS}
    assert "variant" in str(pytest.raises(ValueError, EngineArgs.parse, {"nope": "1"}).value)


def test_negative_controls_are_valid_engine_args():
    assert {"engine": "peft"} in NEGATIVE_CONTROLS
    for args in NEGATIVE_CONTROLS + [a for group in DEVICE_CONTROLS.values() for a in group]:
        EngineArgs.parse({k: v for k, v in args.items() if k != "engine"})
    listed = {a.get("variant") for a in NEGATIVE_CONTROLS} - {None}
    assert {Variant.parse(v).name for v in listed} == {k.split(":")[0] for k in VARIANTS}, "every variant is a control"
    cpu = negative_controls("cpu")  # no graphs and no Triton backend on cpu
    assert cpu == NEGATIVE_CONTROLS, cpu
