"""The reference runner: greedy generation with top-k logprobs, and its content-addressed cache."""

import json

import pytest

from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.models import resolve_base_model
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.types import GenerationRequest

pytest_plugins = ["pytester"]

PROMPTS = ["the old man", "once upon a time there was a dragon who"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, lora_settings):
    model = resolve_base_model("synthetic:llama", lora_settings.cache_dir / "models")
    adapter = synthesize_cached(model, AdapterSpec(seed=9), lora_settings.cache_dir / "adapters")
    return model, adapter


def _requests():
    return [GenerationRequest(p, adapter=a, max_new_tokens=6, prompt_logprobs=True)
            for p in PROMPTS for a in (None, "A")]


def test_identical_second_run_makes_no_forward_pass(world, tmp_path):
    model, adapter = world
    first_runner = ReferenceRunner(model, cache=ReferenceCache(tmp_path))
    first = first_runner.generate(_requests(), {"A": adapter})
    assert first_runner.forward_passes > 0 and first_runner.cache.misses == len(_requests())
    second_runner = ReferenceRunner(model, cache=ReferenceCache(tmp_path))
    second = second_runner.generate(_requests(), {"A": adapter})
    assert second_runner.forward_passes == 0 and second_runner.cache.hits == len(_requests())
    assert [r.to_dict() for r in second] == [r.to_dict() for r in first]


def test_refresh_and_corrupt_entries_are_recomputed(world, tmp_path):
    model, adapter = world
    ReferenceRunner(model, cache=ReferenceCache(tmp_path)).generate(_requests()[:1], {"A": adapter})
    refreshed = ReferenceRunner(model, cache=ReferenceCache(tmp_path, refresh=True))
    refreshed.generate(_requests()[:1], {"A": adapter})
    assert refreshed.forward_passes > 0
    for entry in tmp_path.rglob("*.json"):
        entry.write_text("{not json")
    again = ReferenceRunner(model, cache=ReferenceCache(tmp_path))
    out = again.generate(_requests()[:1], {"A": adapter})
    assert again.forward_passes > 0 and len(out[0].token_ids) == 6
    json.loads(next(tmp_path.rglob("*.json")).read_text())  # rewritten whole


def test_outputs_are_greedy_and_consistent_with_hf_generate(world):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, adapter = world
    runner = ReferenceRunner(model)
    out = runner.generate([GenerationRequest(PROMPTS[1], adapter="A", max_new_tokens=8, prompt_logprobs=True)],
                          {"A": adapter})[0]
    tok = AutoTokenizer.from_pretrained(model)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(adapter)).eval()
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.inference_mode():
        gen = peft_model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.token_ids == gen[0, ids.shape[1]:].tolist()
    assert out.prompt_token_ids == ids[0].tolist()
    assert len(out.prompt_logprobs) == ids.shape[1] - 1 and len(out.logprobs) == 8
    for step, topk in zip(out.token_ids, out.logprobs):
        assert max(topk, key=topk.get) == step  # the chosen token is the top-1
        assert all(v <= 0 for v in topk.values())
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("rows_at_once", [1, 3, 7, 1000])
def test_prompt_logprobs_taken_a_block_at_a_time_are_those_of_the_whole(rows_at_once):
    """The prompt's log-softmax is taken a block of positions at a time (an 8k-token prompt's whole is
    5 GB more): every position's top-k and next-token logprob are bit-identical to the whole's."""
    import torch

    from lora_conformance.reference.runner import _prompt_topk

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 50, generator=g) * 4
    ids = torch.randint(0, 50, (12,), generator=g)
    whole = torch.log_softmax(logits.float(), dim=-1)
    want = []
    for p in range(11):
        vals, top = whole[p].topk(5)
        row = {int(i): float(v) for i, v in zip(top.tolist(), vals.tolist())}
        row.setdefault(int(ids[p + 1]), float(whole[p, ids[p + 1]]))
        want.append(row)
    got = _prompt_topk(logits, ids, 5, rows_at_once=rows_at_once)
    assert got == want
    assert any(len(row) == 6 for row in got)  # some next tokens lie outside the top 5: their logprob is added


def test_cache_key_depends_on_adapter_content(world, tmp_path, lora_settings):
    model, adapter = world
    other = synthesize_cached(model, AdapterSpec(seed=19), lora_settings.cache_dir / "adapters")
    runner = ReferenceRunner(model, cache=ReferenceCache(tmp_path))
    a = runner.generate([GenerationRequest(PROMPTS[0], "X", max_new_tokens=6)], {"X": adapter})[0]
    b = runner.generate([GenerationRequest(PROMPTS[0], "X", max_new_tokens=6)], {"X": other})[0]
    assert runner.cache.misses == 2  # same name, other weights: never a stale hit
    assert a.logprobs != b.logprobs


def test_a_mixed_batch_makes_one_copy_per_adapter_and_keeps_its_order(world, lora_settings):
    model, adapter = world
    other = synthesize_cached(model, AdapterSpec(seed=10), lora_settings.cache_dir / "adapters")
    adapters = {"A": adapter, "B": other}
    mixed = [GenerationRequest(PROMPTS[i % 2], adapter=name, max_new_tokens=4)
             for i, name in enumerate(["A", "B", None, "A", "B", "A"])]
    runner = ReferenceRunner(model, max_models=2)  # the base and one adapted copy at a time
    out = runner.generate(mixed, adapters)
    work = runner.work()
    assert work["copies"] == 2 and work["computed"] == len(mixed) and work["base_loads"] == 1
    assert work["compute_s"] > 0 and work["forward_passes"] == runner.forward_passes
    alone = [ReferenceRunner(model).generate([req], adapters)[0] for req in mixed]
    assert [r.to_dict() for r in out] == [r.to_dict() for r in alone]


def test_one_budget_over_a_process_s_bases_drops_the_least_recent_base_s_models(world, lora_settings):
    """Runners of two bases sharing a LoadedModels: with room for one base's set, using the second drops
    the first's models (oldest first), a later use of the first loads them again, and every output is
    the one a runner alone gives."""
    from lora_conformance.reference.runner import LoadedModels

    model, adapter = world
    moe = resolve_base_model("synthetic:moe", lora_settings.cache_dir / "models")
    moe_adapter = synthesize_cached(moe, AdapterSpec(seed=9), lora_settings.cache_dir / "adapters")
    req = [GenerationRequest(PROMPTS[0], adapter="A", max_new_tokens=4)]
    alone = {m: ReferenceRunner(m).generate(req, {"A": a})[0].to_dict() for m, a in ((model, adapter), (moe, moe_adapter))}
    probe = ReferenceRunner(model)
    probe.generate(req, {"A": adapter})
    one_set = probe.held_bytes()
    assert one_set >= 2 * probe.base_bytes > 0  # the base and its adapted copy
    loaded = LoadedModels(budget=int(1.05 * max(one_set, 2 * ReferenceRunner(moe).base_bytes)))
    first, second = ReferenceRunner(model, loaded=loaded), ReferenceRunner(moe, loaded=loaded)
    assert first.generate(req, {"A": adapter})[0].to_dict() == alone[model]
    assert first.held_bytes() == one_set and loaded.released == 0
    assert second.generate(req, {"A": moe_adapter})[0].to_dict() == alone[moe]
    assert first.held_bytes() == 0 and second.held_bytes() > 0 and loaded.released == 1
    assert first.generate(req, {"A": adapter})[0].to_dict() == alone[model]
    assert second.held_bytes() == 0 and loaded.released == 2
    assert first.work()["base_loads"] == 2 and second.work()["base_loads"] == 1
    roomy = LoadedModels()  # the default budget: small bases keep everything
    both = [ReferenceRunner(m, loaded=roomy) for m in (model, moe)]
    for runner, a in zip(both, (adapter, moe_adapter)):
        runner.generate(req, {"A": a})
    assert roomy.released == 0 and all(r.held_bytes() > 0 for r in both)


def test_the_report_says_what_the_references_cost(pytester):
    pytester.makepyfile(
        "def test_one(lora):\n"
        "    from lora_conformance.types import GenerationRequest\n"
        "    lora.reference([GenerationRequest('the old man', max_new_tokens=2)])\n")
    result = pytester.runpytest_subprocess("--device=cpu", "--lora-report=out", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    work = json.loads((pytester.path / "out" / "report.json").read_text())["environment"]["reference"]["work"]
    assert work["processes"] == 1 and work["computed"] + work["cache_hits"] == 1
    result.stdout.fnmatch_lines(["reference: * cached, * computed in * s *summed over 1 processes"])
    assert "| reference work |" in (pytester.path / "out" / "report.md").read_text()


def test_cache_keys_do_not_depend_on_what_the_process_imported(monkeypatch):
    """A loaded module's ``__version__`` may differ from its distribution's (PyPI's CUDA torch wheels:
    2.11.0+cu130 against 2.11.0): the key reads the distribution's either way, so a process that had
    imported the module first and one that had not compute the same keys."""
    import sys
    import types
    from importlib.metadata import version

    from lora_conformance.reference import runner

    runner._versions.cache_clear()
    monkeypatch.setitem(sys.modules, "peft", types.SimpleNamespace(__version__="0.0.0+local-build"))
    try:
        assert runner._versions()["peft"] == version("peft")
    finally:
        runner._versions.cache_clear()


def test_a_run_stopped_early_still_says_what_its_references_cost(pytester):
    """Each test's teardown carries its process's work so far: a run interrupted (a time limit's
    SIGTERM, ^C) reports what its references computed before it stopped."""
    pytester.makepyfile(
        "def test_one(lora):\n"
        "    from lora_conformance.types import GenerationRequest\n"
        "    lora.reference([GenerationRequest('once upon a time', max_new_tokens=2)])\n"
        "def test_two():\n"
        "    raise KeyboardInterrupt\n")
    result = pytester.runpytest_subprocess("--device=cpu", "--lora-report=out", "-p", "no:cacheprovider")
    assert result.ret == 2, result.stdout.str()  # interrupted
    env = json.loads((pytester.path / "out" / "report.json").read_text())["environment"]
    assert env["interrupted"] is True
    work = env["reference"]["work"]
    assert work["processes"] == 1 and work["computed"] + work["cache_hits"] == 1


def test_the_paired_verdict_scores_adapter_by_adapter(world, lora_settings):
    """The paired verdict's reference scores (each row under its own adapter, the base, and "served as"
    every other adapter of the batch) are made model by model: with room for one adapted copy at a
    time (a real-size base on an accelerator), a batch of three adapters makes two copies per adapter
    (its rows' decodes and own scores, then the others' alternatives on it), not one per score (28
    before), and the verdict is that of a runner that never evicts."""
    from lora_conformance.judge import paired
    from lora_conformance.judge.tolerances import tolerance_for
    from lora_conformance.models import default_prompts

    model, _ = world
    ads = {n: synthesize_cached(model, AdapterSpec(seed=s), lora_settings.cache_dir / "adapters")
           for n, s in (("A", 1), ("B", 2), ("C", 3))}

    class Echo:  # an engine that answers each context with the reference's own top-k
        class limits:
            max_top_k = None

        def __init__(self):
            self.runner = ReferenceRunner(model)

        def generate(self, reqs):
            return self.runner.generate([GenerationRequest(r.prompt, r.adapter, 1, r.top_k) for r in reqs], ads)

    labels = ["A", "B", None, "C", "A", "B", None, "C"]
    verdicts, copies = [], []
    for max_models in (2, 100):
        runner = ReferenceRunner(model, max_models=max_models)
        out = paired.run(paired.plan(labels, default_prompts(), ads), Echo(), runner, tolerance_for("float32"))
        verdicts.append(json.dumps([a.as_evidence() for a in out], sort_keys=True, default=str))
        copies.append(runner.work()["copies"])
    assert verdicts[0] == verdicts[1]
    assert copies[0] <= 2 * len(ads) and copies[1] == len(ads), copies


def test_the_paired_contexts_come_from_the_free_running_decode(world, tmp_path):
    """A greedy decode's first n tokens do not depend on how many follow: the contexts read from the
    check's own 16-token free-running decode are those of an 8-token decode, and the free-running
    reference then finds that decode cached (one decode per row, not two)."""
    from lora_conformance.judge.paired import contexts_of

    model, adapter = world
    for label, path in (("A", adapter), (None, None)):
        for prompt in PROMPTS:
            alone = contexts_of(ReferenceRunner(model), label, prompt, path, 8)
            runner = ReferenceRunner(model, cache=ReferenceCache(tmp_path / f"{label}-{len(prompt)}"))
            shared = contexts_of(runner, label, prompt, path, 8, decode=(16, 5))
            assert shared == alone
            runner.generate([GenerationRequest(prompt, label, 16, 5)], {"A": adapter})
            assert (runner.cache.misses, runner.cache.hits, runner.work()["computed"]) == (1, 1, 1)


def test_step_logprobs_are_the_decodes_own(world):
    """``step_logprobs`` scores ids at a decode step, teacher-forced on the prompt and the tokens
    before it: for the ids the decode reported, the decode's own logprobs (float32, 1e-4); for an
    id outside its top-k, a value below the k-th."""
    model, adapter = world
    runner = ReferenceRunner(model)
    for req in _requests()[:2]:
        path = adapter if req.adapter else None
        ref = runner.generate([req], {"A": adapter})[0]
        for step, top in enumerate(ref.logprobs):
            outside = next(t for t in range(50) if t not in top)
            got = runner.step_logprobs(ref, step, [*top, outside], path)
            assert set(got) == {*top, outside}
            for t, lp in top.items():
                assert abs(got[t] - lp) < 1e-4, (req, step, t)
            assert got[outside] <= min(top.values()) + 1e-5


def _faulty_rotary(runner, calls_wrong):
    """The base's rotary module returns a cos off by 1e-4 (the size of the MKL fault docs/method.md
    describes) on its first ``calls_wrong`` calls, then right."""
    from lora_conformance.reference.rotary_guard import rotary_modules

    (rope,) = rotary_modules(runner._load_base())
    real, calls = rope.forward, [0]

    def forward(*args, **kwargs):
        cos, sin = real(*args, **kwargs)
        calls[0] += 1
        return (cos + 1e-4, sin) if calls[0] <= calls_wrong else (cos, sin)

    rope.forward = forward
    return calls


def test_a_rotary_table_wrong_once_is_computed_again(world):
    """A transient platform fault in the reference's rotary table (rotary_guard.py) never reaches the
    output: the table is computed again, the output equals the fault-free one, and the runner counts it."""
    model, adapter = world
    req = [GenerationRequest(PROMPTS[1], max_new_tokens=4)]
    clean = ReferenceRunner(model).generate(req, {})
    runner = ReferenceRunner(model)
    calls = _faulty_rotary(runner, calls_wrong=1)
    assert [r.to_dict() for r in runner.generate(req, {})] == [r.to_dict() for r in clean]
    assert calls[0] > 2 and runner.work()["rotary_recomputed"] == 1


def test_a_rotary_table_wrong_twice_stops_the_reference(world, tmp_path):
    from lora_conformance.reference.rotary_guard import PlatformFaultError

    model, adapter = world
    runner = ReferenceRunner(model, cache=ReferenceCache(tmp_path))
    _faulty_rotary(runner, calls_wrong=2)
    with pytest.raises(PlatformFaultError, match="wrong twice in a row"):
        runner.generate([GenerationRequest(PROMPTS[0], max_new_tokens=4)], {})
    assert not list(tmp_path.rglob("*.json")), "no reference output cached from a wrong table"


def test_adapted_copies_keep_the_rotary_guard(world):
    from lora_conformance.reference.rotary_guard import rotary_modules, table_error

    model, adapter = world
    runner = ReferenceRunner(model)
    copy = runner._model_for(adapter)
    (rope,) = rotary_modules(copy)
    assert len(rope._forward_hooks) == 1
    import torch

    x, pos = torch.zeros(1, 3, 8), torch.arange(3).view(1, 3)
    cos, sin = rope(x, pos)
    assert table_error(cos, sin) < 1e-6


def _three_adapters(world, tmp_path):
    model, _ = world
    return [synthesize_cached(model, AdapterSpec(seed=s), tmp_path) for s in (71, 72, 73)]


def test_adapted_copies_stay_within_the_copy_budget(world, tmp_path, monkeypatch):
    """A real-shape base's copies (7 GB each in float32) are bounded by MODEL_COPY_BUDGET on every
    device: with room for one, each new adapter's copy replaces the last."""
    from lora_conformance.reference import runner as runner_mod

    model, _ = world
    runner = ReferenceRunner(model, max_models=4)
    base_bytes = runner_mod._param_bytes(runner._load_base())
    monkeypatch.setattr(runner_mod, "MODEL_COPY_BUDGET", base_bytes)  # room for one copy
    for adapter in _three_adapters(world, tmp_path):
        runner._model_for(adapter)
        assert sum(k != "__base__" for k in runner._models) == 1
    assert runner.copies == 3


def test_adapted_copies_dropped_where_the_host_lacks_room(world, tmp_path, monkeypatch):
    """On cpu an older copy is dropped before the next is made while MemAvailable is short of the
    copy (the engine's own weights share the host); with room, copies are kept as before."""
    from lora_conformance import parallel

    model, _ = world
    adapters = _three_adapters(world, tmp_path)
    monkeypatch.setattr(parallel, "available_memory", lambda: 0)
    runner = ReferenceRunner(model, max_models=4)
    for adapter in adapters:
        runner._model_for(adapter)
        assert sum(k != "__base__" for k in runner._models) == 1
    monkeypatch.setattr(parallel, "available_memory", lambda: 1 << 50)
    roomy = ReferenceRunner(model, max_models=4)
    for adapter in adapters:
        roomy._model_for(adapter)
    assert sum(k != "__base__" for k in roomy._models) == 3


def test_released_models_load_again_with_the_same_outputs(world):
    """release_models gives back the base and its adapted copies (the end-of-run audit's room); the
    next output loads them again and is the same, and the rotary guard's count carries over."""
    model, adapter = world
    runner = ReferenceRunner(model)
    reqs = _requests()
    before = runner.generate(reqs, {"A": adapter})
    assert runner._base is not None and runner._models
    guard = runner._rotary
    runner.release_models()
    assert runner._base is None and not runner._models
    assert runner.generate(reqs, {"A": adapter}) == before
    assert runner._rotary is guard
