"""The llamacpp engine's served mode (llama.cpp's ``llama-server``), against the independent oracle
of tests/test_engine_llamacpp.py (a plain single-adapter PeftModel, one prompt at a time, full
forwards). Skipped when no llama-server binary is found (ci/install_llama_server.sh builds one)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_adapter, build_llama, greedy_oracle  # noqa: E402

from lora_conformance.engines.base import (  # noqa: E402
    AdapterNotLoadedError,
    Capability,
    EngineFailure,
    UnsupportedFeatureError,
)
from lora_conformance.engines.llamacpp_server import LlamaServerArgs, find_server  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402

PROMPTS = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
ATOL = 2e-3  # float32 logprobs, llama.cpp's cpu kernels (flash attention off) against torch's


def _binary():
    try:
        return find_server(LlamaServerArgs())
    except EngineFailure as exc:
        pytest.skip(f"no llama-server: {exc}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp_server")
    base = build_llama(root / "llama")
    return {"root": root, "base": base,
            "all": build_adapter(base, root / "all", seed=1),
            "rs": build_adapter(base, root / "rs", seed=2, r=4, alpha=8, use_rslora=True,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}


def _start(ckpt, **args):
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine

    _binary()
    # cache_ram=0: llama-server's host prompt cache can hand one adapter's KV to another
    # (llamacpp_server.FINDINGS["cache_ram"]); these tests check the plugin, so they run without it.
    raw = {"mode": "served", "gguf_cache": str(ckpt["root"] / "gguf"), "n_threads": "2", "parallel": "4", "cache_ram": "0",
           "request_timeout": "120", "startup_timeout": "120", **{k: str(v) for k, v in args.items()}}
    return LlamaCppEngine(ckpt["base"], "cpu", "float32", raw)


@pytest.fixture(scope="module")
def engine(ckpt):
    e = _start(ckpt)
    e.load_adapter("all", ckpt["all"])
    e.load_adapter("rs", ckpt["rs"])
    yield e
    e.close()


def _check(got, ckpt, req, steps):
    prompt_ids, ids, rows = greedy_oracle(ckpt["base"], None if req.adapter is None else ckpt[req.adapter],
                                          req.prompt, steps)
    assert got.prompt_token_ids == prompt_ids
    assert got.token_ids == ids, (req.adapter, req.prompt, got.token_ids, ids)
    assert len(got.logprobs) == steps
    for step, (top, row) in enumerate(zip(got.logprobs, rows)):
        assert list(top)[0] == ids[step]  # the greedy token is the top logprob
        for tid, lp in top.items():
            assert abs(lp - float(row[tid])) < ATOL, (req.adapter, req.prompt, step, tid, lp, float(row[tid]))


def test_the_served_mode_is_the_llamacpp_engine_with_mode_served(engine):
    from lora_conformance.engines.llamacpp_server import LlamaServerEngine

    assert isinstance(engine, LlamaServerEngine) and engine.name == "llamacpp"
    assert {Capability.MIXED_BATCH, Capability.INFLIGHT_LIFECYCLE, Capability.PREFIX_CACHE,
            Capability.CHUNKED_PREFILL} <= engine.capabilities
    reasons = engine.settings()["not_declared"]
    assert "prompt_logprobs" in reasons and "server-context.cpp" in reasons["prompt_logprobs"]


@pytest.mark.parametrize("adapter", [None, "all", "rs"])
def test_each_request_gets_its_adapter(engine, ckpt, adapter):
    req = GenerationRequest(PROMPTS[0], adapter=adapter, max_new_tokens=5, top_k=3)
    _check(engine.generate([req])[0], ckpt, req, 5)


def test_a_mixed_batch_matches_each_rows_own_reference(engine, ckpt):
    labels = [None, "all", "rs", "all", None, "rs"]
    reqs = [GenerationRequest(PROMPTS[i % len(PROMPTS)], adapter=a, max_new_tokens=5, top_k=3)
            for i, a in enumerate(labels)]
    for req, got in zip(reqs, engine.generate(reqs)):
        _check(got, ckpt, req, 5)


def test_the_server_lists_the_adapters_it_holds(engine):
    assert engine.engine_adapters() == engine.list_adapters() == ["all", "rs"]


def test_submitted_requests_finish_while_an_adapter_loads(engine, ckpt):
    reqs = [GenerationRequest(p, adapter="all", max_new_tokens=4, top_k=2) for p in PROMPTS]
    handle = engine.submit(reqs)
    loader = threading.Thread(target=engine.load_adapter, args=("late", ckpt["rs"]))
    loader.start()
    results = handle.result(timeout=120)
    loader.join(timeout=120)
    assert not loader.is_alive() and "late" in engine.list_adapters()
    for req, got in zip(reqs, results):
        _check(got, ckpt, req, 4)
    engine.unload_adapter("late")
    assert engine.engine_adapters() == ["all", "rs"]


def test_bad_input_gets_a_clear_error_and_the_engine_still_serves(engine, ckpt):
    with pytest.raises(AdapterNotLoadedError, match="'nope'"):
        engine.generate([GenerationRequest(PROMPTS[0], adapter="nope", max_new_tokens=2)])
    with pytest.raises(UnsupportedFeatureError, match="prompt logprobs"):
        engine.generate([GenerationRequest(PROMPTS[0], max_new_tokens=2, prompt_logprobs=True)])
    with pytest.raises(EngineFailure, match="n_ctx=512"):
        engine.generate([GenerationRequest(PROMPTS[0], max_new_tokens=600)])
    req = GenerationRequest(PROMPTS[1], adapter="all", max_new_tokens=3, top_k=2)
    _check(engine.generate([req])[0], ckpt, req, 3)


def test_a_missing_binary_is_named(ckpt, tmp_path):
    from lora_conformance.engines.llamacpp_engine import LlamaCppEngine

    with pytest.raises(EngineFailure, match="install_llama_server.sh"):
        LlamaCppEngine(ckpt["base"], "cpu", "float32", {"mode": "served", "server_bin": str(tmp_path / "none"),
                                                         "gguf_cache": str(ckpt["root"] / "gguf")})


def test_close_stops_the_server_process_group(ckpt):
    e = _start(ckpt, parallel=2)
    proc = e._server.proc
    assert proc.poll() is None
    e.close()
    assert proc.poll() is not None
    e.close()  # twice is safe
    with pytest.raises(EngineFailure, match="closed"):
        e.generate([GenerationRequest(PROMPTS[0], max_new_tokens=2)])


def test_finding_init_without_apply_leaves_the_global_scales_at_one(engine, ckpt):
    """llama.cpp's own behaviour, the reason the plugin always sends every adapter's scale
    (llamacpp_server.FINDINGS): when this fails, llama.cpp changed it; update FINDINGS and the docs."""
    listed = engine._server.request("GET", "/lora-adapters")
    assert [e["scale"] for e in listed] == [1.0, 1.0]
    ids = list(engine.tokenizer(PROMPTS[0])["input_ids"])
    body = engine._body(GenerationRequest(PROMPTS[0], max_new_tokens=4, top_k=1), ids, stream=False)
    explicit = engine._server.request("POST", "/completion", body)["tokens"]
    body["lora"] = []
    empty = engine._server.request("POST", "/completion", body)["tokens"]
    _, base, _ = greedy_oracle(ckpt["base"], None, PROMPTS[0], 4)
    assert explicit == base and empty != base


def test_extra_bufts_off_is_llama_servers_no_repack(ckpt):
    """The offline mode's use_extra_bufts=false (llama.cpp's AMX buffers segfault on some hosts) reaches
    llama-server as --no-repack, and the report's settings say it differs from the default."""
    e = _start(ckpt, extra_bufts=0)
    try:
        assert "--no-repack" in e._argv([])
        assert "--no-repack" in e.settings()["differs_from_engine_default"]
        req = GenerationRequest(PROMPTS[1], max_new_tokens=3, top_k=3)
        _check(e.generate([req])[0], ckpt, req, 3)
    finally:
        e.close()


def test_the_served_mode_holds_gguf_bases_and_declares_their_activations(ckpt):
    from lora_conformance.engines.llamacpp_server import LlamaServerEngine
    from lora_conformance.models import quant

    snapped = quant.snapped_checkpoint(ckpt["base"], "q8_0", ckpt["root"] / "q8")  # (q4_k needs rows of 256)
    assert LlamaServerEngine.check_base_quant(snapped) == "q8_0"
    assert LlamaServerEngine.declared_activations(LlamaServerArgs(), snapped, "cpu") == "q8_0"
    assert LlamaServerEngine.declared_activations(LlamaServerArgs(), ckpt["base"], "cpu") is None
