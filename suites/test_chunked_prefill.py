"""Chunked prefill: prompts longer than the prefill chunk, adapters changing inside chunks and at
chunk boundaries, mixed with base rows. Every row (prompt logprobs and decode) must match its own
isolated reference: a chunk that continues a prompt must run with that prompt's adapter and see
the KV its earlier chunks wrote. Prompt logprobs are a feature these tests do not certify: used
where the engine declares them and a probe shows them working (``prompt_logprobs_shown_to_work``);
otherwise the decode, whose every step reads the KV all chunks wrote, is compared alone (the
report says so).
"""

import pytest

from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_xpu_ci
from lora_conformance.types import GenerationRequest

register_cpu_ci(est_time=15, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=20, suite="per-commit")

pytestmark = pytest.mark.requires("mixed_batch")

LABELS = ["A", None, "B", "A", None]
# The chunk sizes: 16, chunks on KV-block boundaries (the built-in engine's block); 13, chunks that end
# inside a block. The chunk-boundary test uses 13 too, so both tests share one engine per size.
ON_BLOCK, INSIDE_BLOCK = 16, 13


def long_prompts(lora, n=len(LABELS), words=0):
    """Six default prompts joined (about 60 tokens): several chunks each at the chunk sizes below.
    ``words`` > 0 (the full profile's long prompts): that many of the default prompts' words, each
    row starting elsewhere in them."""
    ps = lora.prompts
    if words:
        pool = " ".join(ps).split()
        reps = words // len(pool) + 2
        cycle = pool * reps
        return [" ".join(cycle[7 * i: 7 * i + words]) for i in range(n)]
    return [" ".join(ps[(3 * i + j) % len(ps)] for j in range(6)) for i in range(n)]


def context_args(lora):
    """The engine's max_model_len raised to the profile's where its prompts need it (an engine that
    has the arg; another serves what it serves and says so when it cannot)."""
    import dataclasses

    from lora_conformance.models import profiles

    need = profiles.active(lora.harness.settings).max_model_len
    fields = {f.name for f in dataclasses.fields(type(lora.engine).Args)} if hasattr(type(lora.engine), "Args") else set()
    return {"max_model_len": need} if need and "max_model_len" in fields else {}


def requests(prompts, labels, prompt_logprobs=True):
    return [GenerationRequest(prompt=p, adapter=a, max_new_tokens=10, prompt_logprobs=prompt_logprobs)
            for p, a in zip(prompts, labels)]


def check(lora, engine, reqs, label, spanning=None):
    """``spanning``: the requests whose prompts must span three chunks (default: all)."""
    for name in {r.adapter for r in reqs if r.adapter}:
        lora.load(engine, name)
    refs = lora.reference(reqs)
    lora.assert_adapter_visible(refs, reqs, label=f"{label}: adapters vs base")
    chunk = int(engine.args.get("chunked_prefill_size", 0) or 0)
    lengths = [len(r.prompt_token_ids) for r in refs]
    spanning = range(len(reqs)) if spanning is None else spanning
    assert all(lengths[i] > 2 * chunk for i in spanning), (
        f"{label}: prompts {list(spanning)} must span three chunks of {chunk} tokens; prompt lengths {lengths} "
        "(suite defect: lengthen them)")
    lora.assert_matches_reference(engine.generate(reqs), refs, reqs, label=label)


@pytest.mark.feature("chunked_prefill/long_prompts_match_reference",
                     "prompts longer than the prefill chunk, mixed adapters and base rows, match the reference",
                     requires=("chunked_prefill",))
@pytest.mark.profile_param("case", lambda profile: list(profile.long_prompts),
                            ids=lambda c: f"chunk{c[1]}" if not c[0] else f"{c[0]}tok-chunk{c[1]}")
def test_long_prompts_match_reference(lora, device, dtype, case):
    """fast: 16 (chunks on KV-block boundaries) and 13 (chunks that end inside a block) on ~60-token
    prompts; full: 2,048-token prompts in 512-token chunks and 8,192-token prompts in 509-token ones."""
    words, chunk = case
    engine = lora.engine_with(chunked_prefill_size=chunk, **context_args(lora))
    pl = lora.prompt_logprobs_shown_to_work(engine)
    reqs = requests(long_prompts(lora, words=max(words - 1, 0)), LABELS, pl)
    check(lora, engine, reqs, f"chunk {chunk}" + (f", {words}-token prompts" if words else ""))


@pytest.mark.feature("chunked_prefill/adapter_changes_at_chunk_boundary",
                     "a chunk boundary falls where one request's prompt ends and another adapter's begins",
                     requires=("chunked_prefill",))
@pytest.mark.parametrize("first", ["A", None])
def test_adapter_changes_at_chunk_boundary(lora, device, dtype, first):
    """The first prompt is exactly one chunk long: an engine that packs prompts in request order
    ends its first chunk exactly where the next request (another adapter) starts, and later
    boundaries fall inside prompts of other lengths. The chunk is INSIDE_BLOCK tokens (a first
    prompt of the default prompts' words with that count), else the token count of one default
    prompt where no run of words has it (a tokenizer that makes words of several tokens)."""
    from lora_conformance.models import profiles

    profile = profiles.active(lora.harness.settings)
    labels = [first, "B", None if first else "A", "B"]
    # A short first prompt sets the chunk; the later ones span several chunks.
    if profile.boundary_chunk == INSIDE_BLOCK:
        short = lora.prompt_of_tokens(INSIDE_BLOCK) or lora.prompts[5]
        prompts = [short] + long_prompts(lora, len(labels) - 1)
    else:  # the full profile: a first prompt of about boundary_chunk tokens, the others its longest prompts
        short = long_prompts(lora, 1, words=profile.boundary_chunk - 1)[0]
        prompts = [short] + long_prompts(lora, len(labels) - 1, words=max(w for w, _ in profile.long_prompts) - 1)
    probe = lora.reference(requests(prompts[:1], labels[:1], False))[0]
    chunk = len(probe.prompt_token_ids)
    engine = lora.engine_with(chunked_prefill_size=chunk, **context_args(lora))
    pl = lora.prompt_logprobs_shown_to_work(engine)
    check(lora, engine, requests(prompts, labels, pl), f"chunk {chunk} (first = {first or 'base'})",
          spanning=range(1, len(labels)))
