"""The built-in engine's throughput shortcuts compute exactly what the plain formulation does:
LoRA masks from a column->slot map, the decode attention mask, the accelerator weight layout
(fused masked expand; o_proj / down_proj expand inside the base GEMM) run on cpu, and decode
inputs built in one host->device copy."""

from __future__ import annotations

import pytest
import torch

from lora_conformance.engines.builtin import BuiltinEngine
from lora_conformance.engines.builtin.layers import attention
from lora_conformance.engines.builtin.layers.attention import additive_mask, build_mask, decode_mask
from lora_conformance.engines.builtin.layers.linear import CAT_MAX_ROWS, LinearGroup, LoraContext, LoraLinear
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


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 512}])
def test_rotary_tables_are_float64_values_rounded_once(scaling):
    """The cos / sin tables are each float64 value rounded once to float32 (rotary.host_cos_sin), not
    torch's float32 cos, whose MKL path on cpu once returned enhanced-performance accuracy (errors up to
    1.5e-4) for part of a table: every entry within half an ulp of float64, sin's first half negated."""
    import numpy as np

    from lora_conformance.engines.builtin.layers.rotary import RotaryEmbedding, inverse_frequencies

    D, L = 64, 3000
    rope = RotaryEmbedding(D, 10000.0, scaling, L, "cpu", torch.float32)
    angles = torch.outer(torch.arange(L, dtype=torch.float32), inverse_frequencies(D, 10000.0, scaling)).double()
    cos = torch.from_numpy(np.cos(torch.cat([angles, angles], -1).numpy()))
    sin = torch.from_numpy(np.sin(torch.cat([angles, angles], -1).numpy()))
    sin[:, : D // 2] *= -1
    assert torch.equal(rope.cos, cos.float()) and torch.equal(rope.sin_signed, sin.float())
    assert (rope.cos.double() - cos).abs().max() <= 2.0**-25  # half an ulp of 1.0


def _accelerator_layout(eng):
    """Re-fuse every linear group the way accelerators store it ((out, in) rows, transposed views)."""
    groups = {id(m.group): m.group for m in eng.model.modules() if isinstance(m, LoraLinear)}
    for g in groups.values():
        assert isinstance(g, LinearGroup) and g.A is None  # before any adapter pool exists
        g.fuse(transposed=False)
    eng.runner.segmented_prefill = False


def _count_cat_calls(monkeypatch) -> dict:
    """Counts LinearGroup.add_cat_to calls (the expand inside the base GEMM) per module width."""
    calls: dict = {}
    real = LinearGroup.add_cat_to

    def spy(self, out, buf, batch):
        calls[self.in_features] = calls.get(self.in_features, 0) + 1
        return real(self, out, buf, batch)

    monkeypatch.setattr(LinearGroup, "add_cat_to", spy)
    return calls


@pytest.mark.parametrize("attn_into_buffer", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerator_layout_mixed_batch_matches_peft(llama, dtype, attn_into_buffer, monkeypatch):  # noqa: F811
    """attn_into_buffer: decode attention writes into o_proj's [x | shrink] buffer, as it does where
    the SDPA output needs a copy to be (T, H*D) (cuda's efficient attention); cpu's is a free view."""
    monkeypatch.setattr(attention, "DECODE_OUT_ALWAYS", attn_into_buffer)
    calls = _count_cat_calls(monkeypatch)
    base, ads = llama
    with BuiltinEngine(base, "cpu", dtype, {}) as eng:
        _accelerator_layout(eng)
        for n, p in ads.items():
            eng.load_adapter(n, p)
        check_against_reference(eng, base, ads, ["a1", None, "a2", "a1", None], dtype)
        layer = eng.model.model.layers[0]
        o, d = layer.self_attn.o_proj.group, layer.mlp.down_proj.group
        assert o.cat and d.cat  # Bt rides under the base weight: the parts' weights and pools are views of wt
        for g in (o, d):
            assert g.wt.shape == (g.in_features + g.S * g.R, g.N)
            assert g.parts[0].weight.data_ptr() == g.wt.data_ptr()
            assert g.parts[0].lora_Bt.data_ptr() == g.wt[g.in_features:].data_ptr()
    n_in_o, n_in_d = o.in_features, d.in_features
    assert calls.get(n_in_d, 0) > 0  # down_proj took the cat path in decode
    assert (calls.get(n_in_o, 0) > 0) == attn_into_buffer


def _cat_group(bias: bool, S=3, R=4, n_in=24, n_out=16, dtype=torch.float32):
    torch.manual_seed(0)
    ctx = LoraContext()
    m = LoraLinear(n_in, n_out, bias, ctx)
    m.weight.data = torch.randn(n_out, n_in, dtype=dtype)
    if bias:
        m.bias.data = torch.randn(n_out, dtype=dtype)
    g = m.group
    g.cat_input = True
    g.fuse(transposed=False)
    W = m.weight.data.clone()
    g.alloc_pool(S, R)
    A, Bt = torch.randn(S, R, n_in, dtype=dtype), torch.randn(S, R, n_out, dtype=dtype) * 0.1
    for s in range(S):  # as model_runner.load_slots writes a slot
        m.lora_A[s].copy_(A[s])
        m.lora_Bt[s].copy_(Bt[s])
        m.slot_rank[s] = R
    return ctx, m, g, W, A, Bt


@pytest.mark.parametrize("bias", [False, True])
def test_cat_layout_expand_in_the_base_gemm(bias):
    """o_proj / down_proj on the accelerator layout: [x | masked shrink] @ [W^T ; Bt] in one GEMM
    equals the plain formula, base rows (slot -1) get the base output alone, delta_twice doubles
    the delta, and the slot views written by load_slots are the storage the GEMM reads."""
    S, R, n_in, n_out = 3, 4, 24, 16
    ctx, m, g, W, A, Bt = _cat_group(bias, S, R, n_in, n_out)
    assert g.cat and g.wt.shape == (n_in + S * R, n_out)
    assert torch.equal(m.weight, W) and torch.equal(g.wt[:n_in], W.t())
    assert torch.equal(g.wt[n_in:].reshape(S, R, n_out), Bt)  # lora_Bt views wrote into wt
    slots = torch.tensor([0, -1, 2, 1, -1, 5])  # 5: out of range (fault adapter_index_off_by_one): base
    T = len(slots)
    x, res = torch.randn(T, n_in), torch.randn(T, n_out)
    b = m.bias.data if bias else torch.zeros(n_out)
    base = res + x.double() @ W.double().t() + b
    for times in (1, 2):
        ctx.batch = LoraBatch.build(slots, S, torch.float32, times=times,
                                    col_slots=column_slots(S, R, 3, "cpu"), col_rank=R)
        batch = g.cat_batch(T)
        assert batch is ctx.batch
        buf = g.cat_buffer(T)
        assert buf.shape == (T, n_in + S * R)
        g.cat_input_view(buf).copy_(x)
        got = g.add_cat_to(res.clone(), buf, batch)
        ref = base.clone()
        for i, s in enumerate(slots.tolist()):
            if 0 <= s < S:
                ref[i] += times * (x[i].double() @ A[s].double().t()) @ Bt[s].double()
        assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-5)
        base_rows = (slots < 0) | (slots >= S)
        assert torch.allclose(got[base_rows].double(), base[base_rows], atol=1e-4, rtol=1e-5)
        assert torch.equal(buf[base_rows, n_in:], torch.zeros(int(base_rows.sum()), S * R))  # no delta at all
        old = m.add_to(res.clone(), x)  # the two-GEMM path (prefill, lora_fp16) on the same layout
        assert torch.allclose(old.double(), ref, atol=1e-4, rtol=1e-5)
    # lora_fp16, segmented prefill and many rows keep the old path
    ctx.batch = LoraBatch.build(slots, S, torch.float32, delta_dtype=torch.float16)
    assert g.cat_batch(T) is None
    ctx.batch = LoraBatch.build(slots, S, torch.float32, segments=[(0, 0, T)])
    assert g.cat_batch(T) is None
    ctx.batch = LoraBatch.build(slots, S, torch.float32)
    assert g.cat_batch(CAT_MAX_ROWS + 1) is None
    for s in range(S):
        m.slot_rank[s] = 0
    assert g.cat_batch(T) is None  # no adapter here: the base path


def test_cat_layout_only_for_marked_groups_on_accelerators():
    """lm_head (unmarked) and the cpu layout keep their layouts."""
    ctx = LoraContext()
    m = LoraLinear(8, 6, False, ctx)
    m.weight.data = torch.randn(6, 8)
    m.group.fuse(transposed=False)
    m.group.alloc_pool(2, 2)
    assert not m.group.cat and m.group.wt is None and m.group.Bt.is_contiguous()
    c = LoraLinear(8, 6, False, ctx)
    c.weight.data = torch.randn(6, 8)
    c.group.cat_input = True
    c.group.fuse(transposed=True)
    c.group.alloc_pool(2, 2)
    assert not c.group.cat and c.group.Bt.is_contiguous()


@pytest.mark.parametrize("fault", ["delta_twice", "adapter_index_off_by_one", "base_gets_last_adapter",
                                   "lora_fp16"])
def test_accelerator_layout_keeps_routing_faults(llama, fault, monkeypatch):  # noqa: F811
    """The fused masked expand (and the expand in the o_proj / down_proj base GEMM) still carries
    the routing and delta faults it must carry."""
    monkeypatch.setattr(attention, "DECODE_OUT_ALWAYS", True)
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
