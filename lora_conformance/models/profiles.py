"""Certification profiles: the one table that decides the shapes a run certifies (``--profile``).

``fast`` (the default) is what every run used before profiles: small synthetic bases, ranks to 64,
a handful of adapters, prompts of tens of tokens. ``full`` certifies what users serve: bases with
real configs (synthesized offline with the same calibrated design, see synthetic.py), ranks from 1
to 256 crossing every power of two, 64 adapters loaded and 32 in one batch, prompts to 8k tokens
through chunked prefill, and the HF + PEFT reference on the accelerator (float32) where the device
under test is one. The suites read their shapes here (``active``); no suite holds its own literals.
Stdlib only: the plugin reads it before torch is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

PROFILES_DOC = "fast (small synthetic bases, ranks to 64) or full (real shapes, ranks to 256, 8k prompts)"


@dataclass(frozen=True)
class Profile:
    name: str
    # base_model kind (harness/markers) -> the synthetic model the suites use for it
    models: dict = field(default_factory=dict)
    ranks: tuple = (1, 8, 16, 64)  # adapter_semantics/rank (plus the engine's max_rank)
    # mixed_batch/slot_saturation: adapters loaded, and distinct adapters in one batch (0: the engine's own limits)
    loaded_adapters: int = 0
    batch_adapters: int = 0
    # chunked_prefill/long_prompts_match_reference: (prompt tokens, chunk size) cases; prompt tokens 0:
    # six default prompts joined (about 60 tokens)
    long_prompts: tuple = ((0, 16), (0, 13))
    boundary_chunk: int = 13  # chunked_prefill/adapter_changes_at_chunk_boundary's chunk (a prompt of that length)
    max_model_len: int = 0  # engine standard arg for the chunked tests (0: the engine's default)
    reference_on_device: bool = False  # the reference on the device under test (float32) where it is no cpu
    cpu_hours: str = ""  # what the profile would take on cpu (printed at the start of a cpu run)
    # What one worker of ``-n auto`` needs (lora_conformance/parallel.py): host memory, and workers per
    # accelerator (0: parallel.WORKERS_PER_DEVICE).
    worker_memory_gib: float = 2.0
    workers_per_device: int = 0
    # The same on cpu, where the engine's weights share the host with the reference's (0: worker_memory_gib).
    cpu_worker_memory_gib: float = 0.0
    # What one worker holds on an accelerator (0: not bounded by the device's memory).
    device_worker_memory_gib: float = 0.0

    def describe(self, model_configs: Optional[dict] = None) -> dict[str, Any]:
        d = asdict(self)
        d["long_prompts"] = [list(x) for x in self.long_prompts]
        d["ranks"] = list(self.ranks)
        if model_configs:
            d["model_shapes"] = model_configs
        return d


PROFILES: dict[str, Profile] = {
    "fast": Profile("fast", models={"decoder": "synthetic:llama", "moe": "synthetic:moe"}),
    "full": Profile(
        "full",
        models={"decoder": "synthetic:qwen2.5-1.5b", "moe": "synthetic:moe-64e"},
        ranks=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        loaded_adapters=64,
        batch_adapters=32,
        long_prompts=((2048, 512), (8192, 509)),  # chunks on KV-block boundaries / ending inside a block
        boundary_chunk=509,
        max_model_len=8448,
        reference_on_device=True,
        # A worker holds a 1.78 B base in float32 on the host while it loads (7.1 GB), twice with the MoE
        # base; on the device the reference (7.1 GB + up to 12 GiB of adapted copies), the engine and an
        # 8k-token prompt's float32 logits over 151,936 ids (5 GB): four workers ran an H200 (140 GB) out
        # of memory (reports/2026-12-04-builtin-fullprofile-cuda-bfloat16.md).
        worker_memory_gib=16.0,
        workers_per_device=2,
        # nvidia-smi showed 103.6 GB (96.5 GiB) for two such workers on one H200: an 80 GB card takes one
        # (two forced onto an H100 ran it out of memory cold, holding 45.4 + 33.6 GiB; warm, with no
        # reference model loaded, they fit: 36.3 GiB the larger peak).
        device_worker_memory_gib=48.0,
        # On cpu the reference's base and one adapted copy (reference/runner.py MODEL_COPY_BUDGET) and the
        # engine's weights, 7.1 GB each in float32: one worker used 24 GB before the copies were bounded.
        cpu_worker_memory_gib=22.0,
        # Measured on a 2-core cpu (reports/2026-12-05-real-shapes-on-cpu.md).
        cpu_hours="the decoder base costs about 600x the fast profile's per token (1.78 B parameters against "
                  "2.9 M): on 2 cores the base builds in about 2 minutes and a case with cold references takes "
                  "about 2 minutes (llama.cpp's accuracy feature: 9 cases in 17 minutes), so the whole profile "
                  "takes many hours, its 8,192-token prompts most; each worker needs about 22 GiB; limit it by "
                  "feature with -k (e.g. -k test_accuracy)",
    ),
}
NAMES = tuple(PROFILES)


def get(name: Optional[str]) -> Profile:
    if name is None:
        return PROFILES["fast"]
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; expected one of {', '.join(NAMES)}") from None


def active(config_or_settings: Any) -> Profile:
    """The run's profile, from its Settings or its pytest config (the resolved settings where the
    plugin has made them; else the option as given, then its environment variable, then fast)."""
    name = getattr(config_or_settings, "profile", None)
    if name is None and hasattr(config_or_settings, "stash"):
        from lora_conformance.settings import SETTINGS_KEY

        settings = config_or_settings.stash.get(SETTINGS_KEY, None)
        if settings is not None:
            name = settings.profile
        else:
            import os

            name = (config_or_settings.getoption("profile", default=None)
                    or os.environ.get("LORA_CONFORMANCE_PROFILE") or None)
            if name is None:
                try:
                    name = config_or_settings.getini("profile") or None
                except ValueError:
                    name = None
    return get(name)


def model_for(profile: Profile, kind: str) -> Optional[str]:
    """The synthetic model this profile uses for a base_model kind (None: not the profile's to say)."""
    return profile.models.get(kind)


SHAPE_FIELDS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "experts",
                "expert_intermediate", "top_k_experts", "max_positions", "rope_theta")


def model_shape(spec: str) -> dict:
    """The shape of a ``synthetic:<kind>`` model, from its recipe (no model is built): what a report
    states about the bases it certified. Another spec (a directory) is named as it is."""
    if not spec.startswith("synthetic:"):
        return {"model": spec}
    kind = spec.split(":", 1)[1]
    from lora_conformance.models import synthetic

    if kind not in synthetic.DECODER_KINDS:
        return {"model": spec}
    r = synthetic.DecoderRecipe(**synthetic.DECODER_KINDS[kind])
    shape = {f: getattr(r, f) for f in SHAPE_FIELDS}
    shape["vocab"] = r.vocab or 1024
    if not r.experts:
        for f in ("experts", "expert_intermediate", "top_k_experts"):
            del shape[f]
    return {"model": spec, **shape}
