"""What each SGLang release can do with LoRA, read from its source, and the rules it enforces.

Standard library only: the ``sglang`` plugin validates a configuration here, with SGLang's
own error texts, before it starts SGLang (whose start-up failures arrive from a subprocess as
a deep traceback), and the tests check the table without SGLang installed.

The table was read from the PyPI wheels (``pip download sglang==X --no-deps``, unzipped):
``srt/server_args.py`` (from 0.5.23 ``srt/arg_groups/fields/lora.py`` and ``lora_hook.py``),
``srt/lora/lora_manager.py``, ``lora_registry.py``, ``mem_pool.py``,
``srt/managers/tokenizer_*`` (load / unload / eviction), ``srt/mem_cache/`` (radix cache) and
``srt/layers/moe/``. Releases inspected: 0.4.9, 0.4.10, 0.5.1, 0.5.3, 0.5.8, 0.5.13, 0.5.18,
0.5.23. A release between two inspected ones gets the older row: a capability is claimed only
from a release where it was seen.

Rules every inspected release >= 0.5.1 enforces (the texts below are SGLang's):

- ``max_loras_per_batch`` counts the base model as one slot (the memory pool keeps a slot for
  requests without an adapter), so the standard ``max_loras_per_batch=N`` is ``N + 1`` there;
- ``max_loaded_loras >= max_loras_per_batch`` (SGLang's count, base included);
- pinning: refused once ``max_loras_per_batch - 1`` adapters are pinned (one pool slot always
  stays unpinned; with the base's slot that allows pinning N adapters of N + 1 slots);
- loading a name that is loaded: "Failed to load LoRA adapter X because it is already loaded";
- from 0.5.8 loading beyond ``max_loaded_loras`` unregisters the least recently used unpinned
  adapter (always LRU, whatever ``lora_eviction_policy`` says: that policy is the device
  pool's), which a later request naming it loads again; before, such a load is refused;
- from 0.5.8 a request naming more distinct ``lora_path`` values than ``max_loaded_loras`` is
  refused, and the base (``None``) is one of the values counted;
- overlap loading (0.5.8+) needs ``max_loaded_loras <= 2 * max_loras_per_batch``.

MoE (0.5.13+): the loader reads expert LoRA keyed per expert (``...experts.0.<module>...``) or
"shared outer" 3-D tensors (``...experts.<module>...``, lora/lora.py); no release mentions
PEFT's ``target_parameters``, the form the moe suite's adapters take (transformers 5 fused
experts). ``moe`` is declared because SGLang serves MoE LoRA; whether it reads that form is
what the suite will show on the first real run.

Not in any inspected release: ``use_rslora`` and ``rank_pattern`` / ``alpha_pattern`` are not
read from the adapter config (scaling is ``lora_alpha / r``), so rslora and rank_pattern are
never declared; DoRA and adapters adding tokens are refused at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# The rows' shared target-module lists (SUPPORTED_LORA_TARGET_MODULES in srt/utils).
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_MLA = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")


@dataclass(frozen=True)
class Release:
    """What one SGLang release offers for LoRA (the first inspected release with this row)."""

    version: str
    pinning: bool  # load_lora_adapter(pinned=True), refused when it would pin every pool slot
    beyond_max_loaded: str  # "refuse": a load past max_loaded_loras fails; "evict": LRU unpinned is unregistered
    eviction_policies: tuple[str, ...]  # lora_eviction_policy choices (the device pool); () = no such arg
    overlap_loading: bool  # enable_lora_overlap_loading
    radix_cache: bool  # the radix (prefix) cache works with LoRA, keyed by adapter
    moe: bool  # LoRA on MoE experts
    lora_backends: tuple[str, ...]
    default_backend: str
    target_modules: tuple[str, ...]  # lora_target_modules choices ("all" besides)

    @property
    def embed_tokens(self) -> bool:
        return "embed_tokens" in self.target_modules

    @property
    def lm_head(self) -> bool:
        return "lm_head" in self.target_modules


RELEASES: tuple[Release, ...] = (
    # 0.4.9, 0.4.10: "compatibility of lora and radix attention is in progress" (LoRA needs
    # --disable-radix-cache); no pinning, no max_loaded_loras. Older than this plugin maps.
    Release("0.4.9", pinning=False, beyond_max_loaded="refuse", eviction_policies=(), overlap_loading=False,
            radix_cache=False, moe=False, lora_backends=("triton", "flashinfer"), default_backend="triton",
            target_modules=_LINEAR),
    # 0.5.1: LoRARadixCache (keyed by lora id, FCFS schedule only), pinning, max_loaded_loras (hard cap).
    Release("0.5.1", pinning=True, beyond_max_loaded="refuse", eviction_policies=(), overlap_loading=False,
            radix_cache=True, moe=False, lora_backends=("triton",), default_backend="triton", target_modules=_LINEAR),
    # 0.5.3: the chunked SGMV backend (csgmv); the radix cache's key carries the lora id.
    Release("0.5.3", pinning=True, beyond_max_loaded="refuse", eviction_policies=(), overlap_loading=False,
            radix_cache=True, moe=False, lora_backends=("triton", "csgmv"), default_backend="triton",
            target_modules=_LINEAR),
    # 0.5.8: lru/fifo pool eviction, overlap loading, LRU unregistering past max_loaded_loras with
    # reload on use, embed_tokens / lm_head LoRA, ascend and torch_native backends, csgmv default.
    Release("0.5.8", pinning=True, beyond_max_loaded="evict", eviction_policies=("lru", "fifo"),
            overlap_loading=True, radix_cache=True, moe=False,
            lora_backends=("triton", "csgmv", "ascend", "torch_native"), default_backend="csgmv",
            target_modules=_LINEAR + ("embed_tokens", "lm_head")),
    # 0.5.13: MoE expert LoRA (srt/layers/moe), MLA projections.
    Release("0.5.13", pinning=True, beyond_max_loaded="evict", eviction_policies=("lru", "fifo"),
            overlap_loading=True, radix_cache=True, moe=True,
            lora_backends=("triton", "csgmv", "ascend", "torch_native"), default_backend="csgmv",
            target_modules=_LINEAR + _MLA + ("embed_tokens", "lm_head")),
    # 0.5.18: DSA indexer targets; same LoRA surface otherwise.
    Release("0.5.18", pinning=True, beyond_max_loaded="evict", eviction_policies=("lru", "fifo"),
            overlap_loading=True, radix_cache=True, moe=True,
            lora_backends=("triton", "csgmv", "ascend", "torch_native"), default_backend="csgmv",
            target_modules=_LINEAR + _MLA + ("wq_b", "wk", "weights_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")),
    # 0.5.23: the triton_v2 backend (and the LoRA MoE runners that need it); arg groups.
    Release("0.5.23", pinning=True, beyond_max_loaded="evict", eviction_policies=("lru", "fifo"),
            overlap_loading=True, radix_cache=True, moe=True,
            lora_backends=("triton", "csgmv", "ascend", "torch_native", "triton_v2"), default_backend="csgmv",
            target_modules=_LINEAR + _MLA + ("wq_b", "wk", "weights_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")),
)
OLDEST_MAPPED = "0.5.1"  # older releases lack pinning, max_loaded_loras and radix cache with LoRA


def version_tuple(version: str) -> Optional[tuple[int, ...]]:
    """(major, minor, micro) of "0.5.15.post1", "0.5.24.dev3+g1a2b" ...; None when unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not m:
        return None
    return tuple(int(x or 0) for x in m.groups())


def release_for(version: str) -> Release:
    """The newest inspected release not newer than ``version`` (a dev build or a release newer
    than the table gets the newest row). Raises ValueError for releases older than OLDEST_MAPPED
    or an unreadable version."""
    v = version_tuple(version)
    if v is None or v == (0, 0, 0):
        raise ValueError(f"SGLang version {version!r} cannot be read; the capability table "
                         f"(lora_conformance/engines/sglang_releases.py) needs major.minor.micro")
    if v < version_tuple(OLDEST_MAPPED):
        raise ValueError(f"SGLang {version} is older than {OLDEST_MAPPED}, the oldest release this plugin maps "
                         "(no pinning, no max_loaded_loras, LoRA needs the radix cache off)")
    return [r for r in RELEASES if version_tuple(r.version) <= v][-1]


@dataclass(frozen=True)
class ServerConfig:
    """The LoRA server args the plugin passes, in SGLang's own counting."""

    max_loras_per_batch: int  # SGLang's: the base included
    max_loaded_loras: Optional[int]
    max_lora_rank: int
    lora_target_modules: tuple[str, ...]
    lora_backend: Optional[str]
    lora_eviction_policy: Optional[str]
    enable_lora_overlap_loading: bool
    disable_radix_cache: bool
    chunked_prefill_size: Optional[int]
    tp_size: int


class ConfigRefused(ValueError):
    """A configuration SGLang would refuse at start-up; the message is SGLang's, plus why."""


def validate(release: Release, c: ServerConfig) -> None:
    """Refuse, as SGLang ``release`` would at start-up, with its message (server args and
    LoRA hook checks), what it cannot run."""
    def refuse(msg: str) -> None:
        raise ConfigRefused(f"SGLang {release.version}+ refuses this configuration: {msg}")

    if c.max_loras_per_batch <= 0:
        refuse("max_loras_per_batch must be positive")
    if c.max_loaded_loras is not None and c.max_loaded_loras < c.max_loras_per_batch:
        refuse("max_loaded_loras should be greater than or equal to max_loras_per_batch. "
               f"max_loaded_loras={c.max_loaded_loras}, max_loras_per_batch={c.max_loras_per_batch} "
               "(SGLang's max_loras_per_batch counts the base model: the standard max_loras_per_batch="
               f"{c.max_loras_per_batch - 1} is {c.max_loras_per_batch} there, so max_loaded_loras must be "
               f">= {c.max_loras_per_batch})")
    if c.lora_backend is not None and c.lora_backend not in release.lora_backends:
        refuse(f"argument --lora-backend: invalid choice: {c.lora_backend!r} "
               f"(choose from {', '.join(repr(b) for b in release.lora_backends)})")
    if c.lora_eviction_policy is not None:
        if not release.eviction_policies:
            refuse(f"no --lora-eviction-policy before 0.5.8 (asked for {c.lora_eviction_policy!r})")
        if c.lora_eviction_policy not in release.eviction_policies:
            refuse(f"argument --lora-eviction-policy: invalid choice: {c.lora_eviction_policy!r} "
                   f"(choose from {', '.join(repr(p) for p in release.eviction_policies)})")
    if c.enable_lora_overlap_loading:
        if not release.overlap_loading:
            refuse("no --enable-lora-overlap-loading before 0.5.8")
        limit = c.max_loras_per_batch * 2
        if c.max_loaded_loras is None or c.max_loaded_loras > limit:
            refuse("Enabling LoRA overlap loading requires pinning LoRA adapter weights in CPU memory, so "
                   f"--max-loaded-loras must be less than or equal to double --max-loras-per-batch: {limit}")
    if not c.disable_radix_cache and not release.radix_cache:
        refuse("compatibility of lora and radix attention is in progress")
    modules = c.lora_target_modules
    if "all" in modules and len(modules) != 1:
        refuse("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    unknown = [m for m in modules if m != "all" and m not in release.target_modules]
    if unknown:
        refuse(f"argument --lora-target-modules: invalid choice: {unknown[0]!r} "
               f"(choose from {', '.join(repr(m) for m in release.target_modules + ('all',))})")
    if c.max_lora_rank <= 0:
        refuse("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
               "--lora-target-modules for LoRA initialization.")
