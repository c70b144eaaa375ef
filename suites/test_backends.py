"""Backend matrix: every LoRA / attention backend an engine declares (``Engine.backends``) serves a
mixed batch that matches the reference. Prompts of unequal length, adapters and base rows mixed,
prompt logprobs on where a probe shows them working (a feature this test does not certify:
otherwise decode alone, and the report says so): a backend that routes packed rows by a padded
layout, or drops a segment, fails here even when the engine's default backend is right.
"""

import pytest

from lora_conformance.ci import register_cpu_ci, register_cuda_ci, register_xpu_ci
from lora_conformance.outcomes import CAPABILITY, not_certified

register_cpu_ci(est_time=10, suite="per-commit")
register_cuda_ci(est_time=10, suite="per-commit")
register_xpu_ci(est_time=15, suite="per-commit")

pytestmark = pytest.mark.requires("mixed_batch")

LABELS = ["A", None, "B", "A", None, "B"]


def declared_backends(config) -> list[tuple[str, str]]:
    """(engine-arg key, value) for every backend the engine under test declares on this device."""
    from lora_conformance.engines.registry import engine_class
    from lora_conformance.settings import SETTINGS_KEY

    if SETTINGS_KEY not in config.stash:
        return []
    s = config.stash[SETTINGS_KEY]
    return [(key, value) for key, values in engine_class(s.engine).backends(s.device_type).items() for value in values]


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        pairs = declared_backends(metafunc.config) or [None]
        metafunc.parametrize("backend", pairs, ids=[f"{p[0]}={p[1]}" if p else "none-declared" for p in pairs])


@pytest.mark.feature("backends/each_declared_backend_matches_reference",
                     "each LoRA / attention backend the engine declares serves mixed batches that match the reference")
def test_each_declared_backend_matches_reference(lora, device, dtype, backend):
    if backend is None:
        not_certified(CAPABILITY, "engine declares no LoRA / attention backends (Engine.backends)")
    key, value = backend
    engine = lora.engine_with(**{key: value})
    for name in ("A", "B"):
        lora.load(engine, name)
    ps = lora.prompts
    # Unequal lengths: one, two and three default prompts joined.
    prompts = [" ".join(ps[i:i + 1 + i % 3]) for i in range(len(LABELS))]
    pl = lora.prompt_logprobs_shown_to_work(engine)
    reqs = lora.requests(LABELS, prompts=prompts, max_new_tokens=12, prompt_logprobs=pl)
    refs = lora.reference(reqs)
    lora.assert_adapter_visible(refs, reqs, label=f"{key}={value}: adapters vs base")
    lengths = {len(r.prompt_token_ids) for r in refs}
    assert len(lengths) > 2, f"{key}={value}: prompts must differ in length, got token counts {sorted(lengths)}"
    lora.assert_matches_reference(engine.generate(reqs), refs, reqs, label=f"{key}={value}")
