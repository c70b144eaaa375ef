"""The built-in engine's throughput shortcuts compute exactly what the plain formulation does:
LoRA masks from a column->slot map, the decode attention mask, the accelerator weight layout
(fused masked expand) run on cpu, and decode inputs built in one host->device copy."""

from __future__ import annotations

import pytest
import torch

from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.engines.builtin.layers.attention import additive_mask, build_mask, decode_mask
from lora_conformance.engines.builtin.layers.linear import LinearGroup, LoraLinear
from lora_conformance.engines.builtin.layers.lora import LoraBatch, column_slots
from lora_conformance.types import GenerationRequest

from test_builtin_engine import PROMPTS, check_against_reference, llama  # noqa: F401  (fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_masks_equal_the_one_hot_repeats(dtype):
    S, R = 4, 3
    slots = torch.tensor([0, -1, 3, 2, 4, 1, -1])  # 4: out of range (fault adapter_index_off_by_one)
    fast = LoraBatch.build(slots, S, dtype, col_slots=column_slots(S, R, 3, "cpu"), col_rank=R)
    plain = LoraBatch.build(slots, S, dtype)
    for parts in (1, 2, 3):
        ref = plain.onehot.repeat_interleave(R, dim=1).repeat(1, parts)
        got = fast.mask(R, parts)
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, ref), parts
        assert torch.equal(plain.mask(R, parts), ref)
        lead = fast.mask(R, parts, lead=5)
        assert lead.is_contiguous() and torch.equal(lead[:, :5], torch.ones(len(slots), 5, dtype=dtype))
        assert torch.equal(lead[:, 5:], ref)
    assert fast.mask(2, 1).shape == (len(slots), S * 2)  # another rank: the plain construction
    assert torch.equal(fast.rows(torch.tensor([2, 1])).mask(R, 2), ref[[2, 1], : 2 * S * R])


def test_decode_mask_equals_the_general_mask():
    ctx = torch.tensor([1, 5, 16, 17, 32])
    for dtype in (torch.float32, torch.bfloat16):
        ref = additive_mask(build_mask(ctx, torch.ones_like(ctx), 1, 32), dtype)
        assert torch.equal(decode_mask(ctx, 32, dtype), ref)


def _accelerator_layout(eng):
    """Re-fuse every linear group the way accelerators store it ((out, in) rows, transposed views)."""
    groups = {id(m.group): m.group for m in eng.model.modules() if isinstance(m, LoraLinear)}
    for g in groups.values():
        assert isinstance(g, LinearGroup) and g.A is None  # before any adapter pool exists
        g.fuse(transposed=False)
    eng.runner.segmented_prefill = False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerator_layout_mixed_batch_matches_peft(llama, dtype):  # noqa: F811
    base, ads = llama
    with BuiltinEngine(base, "cpu", dtype, {}) as eng:
        _accelerator_layout(eng)
        for n, p in ads.items():
            eng.load_adapter(n, p)
        check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", None], dtype)


@pytest.mark.parametrize("fault", ["delta_twice", "adapter_index_off_by_one", "base_gets_last_adapter",
                                   "lora_fp16"])
def test_accelerator_layout_keeps_routing_faults(llama, fault):  # noqa: F811
    """The fused masked expand still carries the routing and delta faults it must carry."""
    base, ads = llama
    reqs = [GenerationRequest(p, n, max_new_tokens=4, top_k=3) for p, n in zip(PROMPTS, ["a1", None, "a2", "a1"])]
    out = {}
    for f in (None, fault):
        args = {} if f is None else {"fault": f}
        with BuiltinEngine(base, "cpu", "float32", args) as eng:
            _accelerator_layout(eng)
            for n, p in ads.items():
                eng.load_adapter(n, p)
            out[f] = [r.logprobs for r in eng.generate(reqs)]
    assert out[None] != out[fault]


def test_decode_is_deterministic_across_batches(llama):  # noqa: F811
    """One flat host->device copy per step: same results run twice and for a request run alone."""
    base, ads = llama
    reqs = [GenerationRequest(p, n, max_new_tokens=6, top_k=2) for p, n in zip(PROMPTS, ["a1", None, "a2", "a1"])]
    with BuiltinEngine(base, "cpu", "float32", {}) as eng:
        for n, p in ads.items():
            eng.load_adapter(n, p)
        first = eng.generate(reqs)
        again = eng.generate(reqs)
        alone = eng.generate(reqs[2:3])
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert first[2].token_ids == alone[0].token_ids


def test_full_and_strided_masking_agree_bitwise(llama, monkeypatch):  # noqa: F811
    """Fused groups mask their whole output (few rows) or the shrink columns only (many rows): same bits."""
    from lora_conformance.engines.builtin.layers import linear

    base, ads = llama
    reqs = [GenerationRequest(p, n, max_new_tokens=5, top_k=3) for p, n in zip(PROMPTS, ["a1", None, "a2", "a1"])]
    out = []
    for rows in (linear.FULL_MASK_MAX_ROWS, 0):
        monkeypatch.setattr(linear, "FULL_MASK_MAX_ROWS", rows)
        with BuiltinEngine(base, "cpu", "bfloat16", {}) as eng:
            _accelerator_layout(eng)
            for n, p in ads.items():
                eng.load_adapter(n, p)
            out.append([(r.token_ids, r.logprobs) for r in eng.generate(reqs)])
    assert out[0] == out[1]
