"""The openvino engine's ``mode=continuous_batching`` (GenAI's ContinuousBatchingPipeline through
add_request / step, each request with its own adapters) against an independent oracle: a plain
single-adapter PeftModel, one prompt at a time, greedy by full forwards.

What GenAI 2026.4.1 serves that way is pinned here with GenAI alone (the evidence behind
``expectations/openvino-cb-cpu.toml``): add_request never applies a request's adapters. The
plugin's side is checked apart from it: the configs it submits serve each adapter's reference
when GenAI is asked through ``generate()``, which does apply them. Skipped without openvino-genai."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("openvino_genai")

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_models import build_adapter, build_llama, greedy_oracle  # noqa: E402

from lora_conformance.engines.base import (  # noqa: E402
    AdapterNotLoadedError,
    Capability,
    EngineFailure,
    UnsupportedFeatureError,
)
from lora_conformance.engines.args import EngineArgError  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402

ATOL = 1e-4  # float32 logprobs: OpenVINO's CPU kernels against torch's
PROMPTS = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
STEPS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("openvino_cb")
    base = build_llama(root / "llama")
    return {"root": root, "base": base,
            "a1": build_adapter(base, root / "a1", seed=1),
            "a2": build_adapter(base, root / "a2", seed=2, target_modules=["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def oracles(ckpt):
    """(prompt, adapter) -> (prompt ids, generated ids, chosen-token logprobs) of the PEFT oracle."""
    out = {}
    for prompt in PROMPTS:
        for name in (None, "a1", "a2"):
            prompt_ids, ids, rows = greedy_oracle(ckpt["base"], ckpt[name] if name else None, prompt, STEPS)
            out[prompt, name] = prompt_ids, ids, [float(row[t]) for row, t in zip(rows, ids)]
    return out


def make_engine(ckpt, **args):
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    args = {"ir_cache": str(ckpt["root"] / "ir"), "mode": "continuous_batching", **args}
    return OpenVINOEngine(ckpt["base"], "cpu", "float32", args)


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = make_engine(ckpt)
    eng.load_adapter("a1", ckpt["a1"])
    eng.load_adapter("a2", ckpt["a2"])
    yield eng
    eng.close()


def close_to(out, want):
    """The engine's tokens and chosen-token logprobs are the oracle's."""
    prompt_ids, ids, lps = want
    got = [step[t] for step, t in zip(out.logprobs, out.token_ids)]
    return (out.prompt_token_ids == prompt_ids and out.token_ids == ids
            and max(abs(a - b) for a, b in zip(got, lps)) < ATOL)


def test_declares_mixed_batches_and_in_flight_requests(engine):
    from lora_conformance.engines.openvino_engine import OpenVINOArgs, OpenVINOEngine

    assert {Capability.MIXED_BATCH, Capability.INFLIGHT_LIFECYCLE, Capability.CHUNKED_PREFILL,
            Capability.PREFIX_CACHE} <= engine.capabilities
    assert engine.limits.max_loras_per_batch == 4
    reasons = OpenVINOEngine.not_declared_reasons(engine.cfg, engine.model_dir, "cpu")
    assert Capability.MIXED_BATCH not in reasons and Capability.INFLIGHT_LIFECYCLE not in reasons
    assert not set(reasons) & engine.capabilities
    for cap in (Capability.MAX_LOADED, Capability.EMBEDDINGS, Capability.OVERLAP_LOADING):
        assert "openvino.genai/blob/" in reasons[cap], (cap, reasons[cap])
    # mode=generate cannot take more than one adapter per call: refused where the args are read.
    with pytest.raises(UnsupportedFeatureError, match="max_loras_per_batch=2 in mode=generate"):
        OpenVINOEngine.parse_args({"max_loras_per_batch": "2"})
    assert OpenVINOEngine.parse_args({"mode": "continuous_batching", "max_loras_per_batch": "2"}) == OpenVINOArgs(
        mode="continuous_batching", max_loras_per_batch=2)
    with pytest.raises(EngineArgError, match="mode"):
        OpenVINOEngine.parse_args({"mode": "batched"})


def test_the_submitted_configs_serve_each_adapter_through_generate(ckpt, oracles):
    """The plugin's half: the GenerationConfig each request is submitted with carries its own adapter
    and blend weight. GenAI's generate() (which applies a call's adapters) serves each one its
    oracle, so what add_request serves from the same configs is GenAI's doing. (An engine of its
    own: generate() leaves its adapters applied for the requests added after it.)"""
    eng = make_engine(ckpt)
    try:
        eng.load_adapter("a1", ckpt["a1"])
        eng.load_adapter("a2", ckpt["a2"])
        pipe, tok = eng._pipe, eng._tokenizer
        for name in (None, "a1", "a2"):
            req = GenerationRequest(PROMPTS[0], adapter=name, max_new_tokens=STEPS)
            served = pipe.generate([tok.encode(req.prompt).input_ids], [eng._config(req, name)])[0]
            assert list(served.m_generation_ids[0]) == oracles[PROMPTS[0], name][1], name
    finally:
        eng.close()


def test_genai_add_request_ignores_the_request_adapters(ckpt, oracles):
    """GenAI alone (no plugin code on the serving path): requests added with their own
    ``GenerationConfig.adapters`` are all served with whatever LoRA state the pipeline's infer
    request holds: none on a fresh pipeline (every row is the base model's), and after a
    ``generate()`` with a1, a1's for every row, the base rows included. The evidence behind
    expectations/openvino-cb-cpu.toml."""
    import openvino_genai as g

    from lora_conformance.engines.openvino_convert import converted_model

    ir = converted_model(ckpt["base"], ckpt["root"] / "ir")
    adapters = {n: g.Adapter(str(ckpt[n] / "adapter_model.safetensors")) for n in ("a1", "a2")}
    every = g.AdapterConfig()
    for a in adapters.values():
        every.add(a, 2.0)
    sched = g.SchedulerConfig()
    sched.cache_size = 1
    pipe = g.ContinuousBatchingPipeline(str(ir), sched, "CPU", {
        "adapters": every, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    ids = pipe.get_tokenizer().encode(PROMPTS[0]).input_ids

    def config(name):
        c = g.GenerationConfig()
        c.max_new_tokens, c.do_sample = STEPS, False
        c.adapters = g.AdapterConfig(adapters[name], 2.0) if name else g.AdapterConfig()  # a1, a2: alpha 16 / r 8
        return c

    def add_requests():
        handles = [pipe.add_request(i, ids, config(n)) for i, n in enumerate((None, "a1", "a2"))]
        while pipe.has_non_finished_requests():
            pipe.step()
        return [list(h.read_all()[0].generated_ids) for h in handles]

    want = {n: oracles[PROMPTS[0], n][1] for n in (None, "a1", "a2")}
    assert len({tuple(v) for v in want.values()}) == 3, "suite defect: the adapters do not change the oracle's tokens"
    assert add_requests() == [want[None]] * 3  # fresh: every row the base
    assert list(pipe.generate([ids], [config("a1")])[0].m_generation_ids[0]) == want["a1"]
    assert add_requests() == [want["a1"]] * 3  # after generate(a1): every row a1
    # generate()'s "same adapters" check compares the configs' emptiness only (AdapterConfig has no
    # operator==; its operator bool is what std::optional's == reaches): a base row beside an
    # adapter row is refused, but a2 beside a1 passes and is served a1 (the first request's).
    with pytest.raises(RuntimeError, match="LoRA adapters value must be the same for all requests"):
        pipe.generate([ids, ids], [config("a1"), config(None)])
    both = pipe.generate([ids, ids], [config("a1"), config("a2")])
    assert [list(r.m_generation_ids[0]) for r in both] == [want["a1"], want["a1"]]


def test_a_mixed_batch_runs_as_one_continuous_batch(engine, oracles):
    """Base and adapter rows in one call, all submitted at once with their own adapters. Base rows
    match the base oracle (tokens, logprobs, prompt ids, in request order); the adapter rows get
    what GenAI's add_request serves them, the base model (the test above), not their adapters."""
    labels = [None, "a1", "a2", None, "a1", "a2"]
    requests = [GenerationRequest(PROMPTS[i % 3], adapter=a, max_new_tokens=STEPS) for i, a in enumerate(labels)]
    outputs = engine.generate(requests)
    assert len(outputs) == len(requests)
    for req, out in zip(requests, outputs):
        assert close_to(out, oracles[req.prompt, None]), (req.adapter, out.token_ids)
        if req.adapter is not None:
            assert not close_to(out, oracles[req.prompt, req.adapter]), req.adapter


def test_requests_submitted_while_others_run(ckpt, engine, oracles):
    """An in-flight case: a long request runs; another request is submitted and served meanwhile;
    an unload of the name the long request uses waits for it (the interface's rule)."""
    engine.load_adapter("long", ckpt["a2"])
    running = engine.submit([GenerationRequest(PROMPTS[1], adapter="long", max_new_tokens=1000, ignore_eos=True)])
    assert running.wait_started(120)
    assert not running.done(), "the long request finished before the test could add one beside it"
    beside = engine.submit([GenerationRequest(PROMPTS[0], adapter=None, max_new_tokens=STEPS)])
    assert close_to(beside.result(120)[0], oracles[PROMPTS[0], None])
    unloaded = threading.Event()
    unloader = threading.Thread(target=lambda: (engine.unload_adapter("long"), unloaded.set()))
    unloader.start()
    out = running.result(120)[0]
    unloader.join(120)
    assert unloaded.is_set() and "long" not in engine.list_adapters()
    assert len(out.token_ids) == 1000 and len(out.logprobs) == 1000
    assert out.token_ids[:STEPS] == oracles[PROMPTS[1], None][1]  # served as the base: GenAI's add_request


def test_bad_input_gives_a_clear_error_and_the_loop_goes_on(engine, oracles):
    with pytest.raises(AdapterNotLoadedError, match="'nope'"):
        engine.generate([GenerationRequest(PROMPTS[0], adapter="nope")])
    with pytest.raises(UnsupportedFeatureError, match="prompt top-k"):
        engine.generate([GenerationRequest(PROMPTS[0], prompt_logprobs=True)])
    # GenAI refuses the second request at add_request: the call fails at once, naming it, and the
    # first one (already queued) is cancelled, not left running.
    with pytest.raises(EngineFailure, match="GenAI refused request 1 .*max_new_tokens"):
        engine.generate([GenerationRequest(PROMPTS[0], max_new_tokens=3),
                         GenerationRequest(PROMPTS[1], max_new_tokens=0)])
    assert close_to(engine.generate([GenerationRequest(PROMPTS[2], max_new_tokens=STEPS)])[0],
                    oracles[PROMPTS[2], None])
    assert engine._loop.running() == 0


def test_chunked_prefill_size_sets_genai_s_split(ckpt, oracles):
    """chunked_prefill_size=2 splits the prompts over several steps (GenAI's dynamic_split_fuse);
    base rows still match the oracle, so the chunks see the KV their earlier chunks wrote."""
    eng = make_engine(ckpt, chunked_prefill_size="2")
    try:
        prompts = [PROMPTS[0], PROMPTS[2]]
        outs = eng.generate([GenerationRequest(p, max_new_tokens=STEPS) for p in prompts])
        for p, out in zip(prompts, outs):
            assert len(out.prompt_token_ids) > 2 * 2, "suite defect: the prompt fits in two chunks"
            assert close_to(out, oracles[p, None]), (p, out.token_ids)
    finally:
        eng.close()


def test_close_fails_what_is_in_flight_without_hanging(ckpt):
    eng = make_engine(ckpt)
    handle = eng.submit([GenerationRequest(PROMPTS[1], max_new_tokens=5000, ignore_eos=True)])
    assert handle.wait_started(120)
    eng.close()
    with pytest.raises(EngineFailure, match="closed"):
        handle.result(60)
    eng.close()  # twice is safe


def test_lora_backends_are_genai_s_adapter_modes_and_static_serves_the_build_s_adapter(ckpt, oracles):
    """The backends the suite runs are GenAI's AdapterConfig modes. With ``static`` (A, B and alpha
    constants of the compiled model) GenAI serves the adapter the pipeline was built with to every
    added request, the base row included: the evidence behind the backends entry of
    openvino-cb-cpu.toml."""
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    assert OpenVINOEngine.backends("cpu") == {"lora_backend": ("dynamic", "static_rank", "static", "fuse")}
    assert OpenVINOEngine.parse_args({"lora_backend": "fuse"}).lora_backend == "fuse"
    eng = make_engine(ckpt, lora_backend="static")
    try:
        eng.load_adapter("a1", ckpt["a1"])
        outs = eng.generate([GenerationRequest(PROMPTS[0], adapter=a, max_new_tokens=STEPS) for a in (None, "a1")])
        assert [o.token_ids for o in outs] == [oracles[PROMPTS[0], "a1"][1]] * 2
    finally:
        eng.close()
