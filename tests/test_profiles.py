"""Certification profiles (models/profiles.py), the real-shape synthetic recipes, the execution modes
the built-in engine declares, and the plan decisions of the kernel-threshold and mode faults."""

import pytest
import torch

from lora_conformance.models import profiles, synthetic
from lora_conformance.models.design import hadamard_basis


def test_full_profile_crosses_every_power_of_two_to_256():
    full = profiles.get("full")
    assert list(full.ranks) == [2 ** i for i in range(9)]
    assert (full.loaded_adapters, full.batch_adapters) == (64, 32)
    assert max(t for t, _ in full.long_prompts) == 8192
    assert all(t > 2 * chunk for t, chunk in full.long_prompts), "each long prompt must span three chunks"
    assert full.max_model_len > 8192 + 16, "room for the 8k prompts and their decode"


def test_fast_profile_is_the_suites_earlier_shapes():
    fast = profiles.get(None)
    assert fast.name == "fast" and fast.ranks == (1, 8, 16, 64)
    assert fast.models == {"decoder": "synthetic:llama", "moe": "synthetic:moe"}
    assert fast.long_prompts == ((0, 16), (0, 13)) and not fast.batch_adapters and not fast.reference_on_device


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError, match="fast, full"):
        profiles.get("huge")


def test_real_shapes_are_the_real_configs():
    shape = profiles.model_shape("synthetic:qwen2.5-1.5b")
    assert {k: shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")} == {
        "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128, "intermediate": 8960,
        "vocab": 151936}
    moe = profiles.model_shape("synthetic:moe-64e")
    assert moe["experts"] >= 60 and moe["vocab"] == 151936
    assert profiles.model_shape("/some/dir") == {"model": "/some/dir"}
    cfg = synthetic.decoder_config(synthetic.DecoderRecipe(**synthetic.DECODER_KINDS["qwen2.5-1.5b"]), 151936)
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.rope_theta if hasattr(cfg, "rope_theta") else 1e6) == (
        "qwen2", 2, 1e6)


def test_fast_kinds_keep_their_cache_keys():
    """Fields added for the real shapes stay out of the older kinds' recipes (their cache keys)."""
    for kind in ("llama", "moe", "llama-hd128", "qwen2"):
        d = synthetic.DecoderRecipe(**synthetic.DECODER_KINDS[kind]).to_dict()
        assert "vocab" not in d and "top_k_experts" not in d


@pytest.mark.parametrize("n", [256, 1536, 3584])
def test_code_basis_is_orthonormal_at_any_width(n):
    b = hadamard_basis(n, torch.Generator().manual_seed(0))
    assert b.shape == (n, n)
    torch.testing.assert_close(b.T @ b, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


def test_builtin_declares_its_exec_modes():
    from lora_conformance import devices
    from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine

    assert BuiltinEngine.exec_modes("cpu") == {"exec_mode": ("eager",)}
    cuda = BuiltinEngine.exec_modes("cuda")["exec_mode"]
    assert cuda[0] == "eager" and ("compile" in cuda) == devices.triton_backend("cuda")
    assert ("graphs" in cuda) == devices.graphs_supported("cuda")


def test_exec_mode_graphs_is_graphs_1_and_refused_where_no_graphs():
    from lora_conformance.engines.builtin.args import EngineArgs
    from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine

    assert EngineArgs.parse({"graphs": "1"}).decode_mode == "graphs"
    assert EngineArgs.parse({"exec_mode": "compile"}).decode_mode == "compile"
    assert "not supported on cpu" in BuiltinEngine._mode_refusal(EngineArgs.parse({"exec_mode": "graphs"}), "cpu")
    assert BuiltinEngine._mode_refusal(EngineArgs.parse({"exec_mode": "compile"}), "cpu") is None
    with pytest.raises(Exception, match="exec_mode"):
        EngineArgs.parse({"exec_mode": "fast"})


def test_threshold_faults_take_their_path_only_above_the_threshold():
    from lora_conformance.engines.builtin.args import EngineArgs
    from lora_conformance.engines.builtin.engine.plan import EnginePlan

    wrap = EnginePlan.decide(EngineArgs.parse({"fault": "batch_over_16_adapters_wraps"}), "cpu", torch.float32)
    sixteen = list(range(16)) + [-1]
    assert wrap.routing.route(sixteen) == sixteen
    assert wrap.routing.route(list(range(20)) + [-1]) == list(range(16)) + [0, 1, 2, 3, -1]
    assert EnginePlan.decide(EngineArgs.parse({}), "cpu", torch.float32).routing.route(list(range(20))) == list(range(20))
    rank = EnginePlan.decide(EngineArgs.parse({"fault": "rank_ge_128_truncated"}), "cpu", torch.float32)
    assert rank.adapters.rank_tile == (128, 64)
    long = EnginePlan.decide(EngineArgs.parse({"fault": "positions_over_4096_as_base"}), "cpu", torch.float32)
    assert long.routing.by_position([0, 1, 2, -1], [0, 4095, 4096, 9000]) == [0, 1, -1, -1]
    healthy = EnginePlan.decide(EngineArgs.parse({}), "cpu", torch.float32)
    assert healthy.routing.by_position([3, 3], [4096, 9000]) == [3, 3]
    compiled = EnginePlan.decide(EngineArgs.parse({"fault": "compile_drops_lora"}), "cpu", torch.float32)
    assert not compiled.compiled_applies_lora and EnginePlan.decide(EngineArgs.parse({}), "cpu",
                                                                     torch.float32).compiled_applies_lora


def test_suites_take_their_shapes_from_the_profile(pytester):
    """Collection alone: the rank, saturation and chunked-prefill cases follow --profile."""
    import shutil

    from lora_conformance.settings import suites_dir

    shutil.copytree(suites_dir(), pytester.path / "suites")
    ids = {}
    for name in ("fast", "full"):
        result = pytester.runpytest_inprocess("suites/test_adapter_semantics.py", "suites/test_chunked_prefill.py",
                                              "--collect-only", "-q", f"--profile={name}", "-p", "no:cacheprovider")
        ids[name] = [line for line in result.outlines if "::" in line]
    full_ranks = [i for i in ids["full"] if "test_rank[" in i]
    assert len(full_ranks) == 10 and any("-256]" in i or "[256-" in i or "256" in i for i in full_ranks), full_ranks
    assert len([i for i in ids["fast"] if "test_rank[" in i]) == 5
    assert any("8192tok-chunk509" in i for i in ids["full"]) and not any("tok-chunk" in i for i in ids["fast"])


def test_certify_modes_combination_passes_only_what_passes_in_every_mode():
    import importlib.util

    from lora_conformance.settings import repo_root

    spec = importlib.util.spec_from_file_location("certify_modes", repo_root() / "bench" / "certify_modes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    combined = mod.combine({"exec_mode=eager": {"a": "passed", "b": "passed", "c": "not certified"},
                            "exec_mode=compile": {"a": "passed", "b": "failed", "c": "passed"}})
    assert {f: v["status"] for f, v in combined.items()} == {"a": "passed", "b": "failed", "c": "not certified"}
    assert mod.combine({"m1": {"a": "passed"}, "m2": {}})["a"]["status"] == "not run"


def test_real_bases_are_judged_by_the_real_rows():
    """The tolerance rows follow the base's scale class: the fast profile's bases take the small rows,
    the full profile's (and any base of real width, depth or vocabulary) the real ones, measured at
    those shapes; float32 is the same at both."""
    from lora_conformance.judge.tolerances import SCALES, scale_of_config, tolerance_for

    for kind, v in synthetic.DECODER_KINDS.items():
        r = synthetic.DecoderRecipe(**v)
        cfg = {"hidden_size": r.hidden, "num_hidden_layers": r.layers, "vocab_size": r.vocab or 1024}
        want = "real" if f"synthetic:{kind}" in profiles.get("full").models.values() or kind == "qwen2.5-7b" else "small"
        assert scale_of_config(cfg) == want, kind
    assert scale_of_config({"text_config": {"hidden_size": 4096}}) == "real"
    assert scale_of_config({"hidden_size": "n/a"}) == "small"
    small, real = tolerance_for("bfloat16"), tolerance_for("bfloat16", "real")
    assert (small.scale, real.scale) == ("small", "real") and SCALES == ("small", "real")
    assert real.decode_atol > small.decode_atol and real.effect_noise_max > small.effect_noise_max
    assert real.effect_slope_margin == small.effect_slope_margin, "the precise verdict's margin is not widened"
    f32 = tolerance_for("float32", "real")
    assert f32.decode_atol == tolerance_for("float32").decode_atol
    with pytest.raises(ValueError, match="small, real"):
        tolerance_for("bfloat16", "huge")


def test_the_report_states_the_profiles_ranks_and_shapes():
    """report.md and the HTML report (both environment_rows) say what a run certified: the profile's
    ranks, adapter counts and prompt lengths, and its bases' shapes; the decoder's only where the run
    used the profile's decoder."""
    from types import SimpleNamespace

    from lora_conformance.report.environment import fingerprint
    from lora_conformance.report.markdown import environment_rows

    def rows(profile, base_model):
        settings = SimpleNamespace(device="cuda", engine="builtin", engine_args={}, dtype="bfloat16",
                                   reference_device="cuda", reference_dtype="float32", base_model=base_model,
                                   base_quant="none", profile=profile)
        return dict(environment_rows(fingerprint(settings, {"device": {"device_name": "test"}})))

    full = rows("full", "synthetic:qwen2.5-1.5b")
    assert full["profile"].startswith("full: ranks 1, 2, 4, 8, 16, 32, 64, 128, 256 (and the engine's max_rank); "
                                      "64 adapters loaded, 32 in one batch")
    assert "8192 tokens in chunks of 509" in full["profile"] and "on the device under test" in full["profile"]
    assert full["decoder base shape"] == ("synthetic:qwen2.5-1.5b: hidden 1,536, 28 layers, 12 heads (2 kv, head_dim "
                                          "128), intermediate 8,960, vocab 151,936, 32,768 positions")
    assert "64 experts" in full["moe base shape"]
    other = rows("full", "synthetic:llama")
    assert "decoder base shape" not in other and other["base model"] == "synthetic:llama"
    fast = rows("fast", "synthetic:llama")["profile"]
    assert fast.startswith("fast: ranks 1, 8, 16, 64 (and the engine's max_rank); adapters loaded and"), fast
