"""The ``sglang`` engine: SGLang with LoRA enabled, offline (``sglang.Engine``) or served.

Run for real on SGLang 0.5.15.post1 on a CPU-only host (``ci/install_sglang_cpu.sh``;
docs/sglang.md has the runs, what is declared and the evidence for what is not); the
stand-in of tests/_sglang_standin.py checks the mapping for the other releases the table in
``sglang_releases.py`` maps.

Two modes (engine arg ``mode``):

- ``offline`` (default): ``sglang.Engine(**server_args)`` in this process; its scheduler and
  detokenizer are processes SGLang spawns.
- ``served``: ``python -m sglang.launch_server`` (the interpreter of ``python``, default this one)
  bound to 127.0.0.1 on a free port, started and stopped (its whole process group) by the
  plugin; requests go to SGLang's native routes ``POST /generate`` (the same fields as
  ``Engine.generate``), ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/flush_cache``, and
  ``GET /v1/models`` (the adapters SGLang holds). Only here is the in-flight lifecycle declared:
  ``submit`` streams each request (``"stream": true``) on a thread of its own while adapters
  load and unload through the server, and SGLang itself drains an adapter before unloading it
  (``srt/lora/lora_registry.py``: ``unregister`` then ``wait_for_unload`` until no request
  holds it); the plugin does not wait in its place. The offline ``Engine`` runs every call
  with ``loop.run_until_complete`` on one event loop (``srt/entrypoints/engine.py``), so it
  cannot take a load while a generate runs: not declared there.

On a host without an accelerator, and only there, the plugin applies the one change it makes
to SGLang's environment: ``pin_memory`` is a no-op in SGLang's processes
(``lora_conformance/engines/sglang_cpu_workaround``; sgl-project/sglang#31894: every LoRA
backend asks for pinned memory per batch, which PyTorch refuses without an accelerator). The
version string, the report's engine settings and the matrix row name it. On cpu the plugin also
sets ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own switch for a host without sgl_kernel) and, where
the run does not choose, ``attention_backend=torch_native`` and ``lora_backend=torch_native``:
SGLang's cpu defaults (``intel_amx`` attention, ``csgmv`` LoRA) need sgl_kernel's CPU ops and
Triton, neither of which exists on such a host (``settings()`` lists them as ours).

Capabilities come from the installed release's row in ``sglang_releases.RELEASES``
(``sglang.__version__``), the configuration and the device: the radix cache (prefix_cache)
unless turned off, pinning, host-cache eviction past max_loaded_loras (max_loaded, 0.5.8+), the
configured pool eviction policy, overlap loading, embed_tokens / lm_head (0.5.8+, when
targeted), MoE (0.5.13+, not on cpu), graphs unless disabled, tensor parallel (not on cpu).
Never rslora, rank_pattern, DoRA, modules_to_save or LoRA biases (``NOT_DECLARED`` has the
source lines).

Standard args in SGLang's words: max_loras_per_batch -> max_loras_per_batch + 1 (SGLang
counts the base model as a slot), max_loaded_loras, max_rank -> max_lora_rank, eviction ->
lora_eviction_policy, overlap_loading -> enable_lora_overlap_loading, prefix_cache ->
disable_radix_cache (inverted), graphs -> disable_cuda_graph (inverted), lora_backend,
chunked_prefill_size, tensor_parallel -> tp_size. A configuration SGLang would refuse at
start-up is refused here first (UnsupportedFeatureError, with SGLang's message).

What the plugin does in SGLang's place (nothing else is refused or repaired; SGLang gets every
adapter as it is): a start-up configuration SGLang refuses is refused first with SGLang's own
message (its checks run in ``ServerArgs.__post_init__`` inside a subprocess, whose traceback would
otherwise be the only trace); a name loaded again is unloaded first (SGLang answers "already
loaded"); a request naming an adapter the plugin has not loaded is refused before sending
(SGLang would load it again from its ``lora_ref_cache``); the first prompt-logprob entry (None)
is dropped and top-k lists become dicts (format).

Requests: one ``generate`` call (offline) or one ``/generate`` body (served) per batch:
``text``/``prompt=[...]``, one sampling-params dict per request (``temperature=0``,
``max_new_tokens``, ``ignore_eos``), ``lora_path=[name or None]``, ``return_logprob=True``,
``top_logprobs_num=[k]``, ``logprob_start_len=[0 or -1]``; ``meta_info["output_top_logprobs"]``
per step a list of ``(logprob, token_id, text)``; ``meta_info["input_top_logprobs"]`` the same per
prompt position, the first one None (dropped, so entry i predicts token i+1); token ids from
``output_ids``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines import sglang_cpu_workaround as workaround
from lora_conformance.engines import served
from lora_conformance.engines._hf_common import is_encoder_only, load_tokenizer, trim_topk
from lora_conformance.engines.args import Rename, Via, arg, capability_list
from lora_conformance.engines.args import install_hint
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    CapacityError,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    FuturesHandle,
    RequestHandle,
    UnsupportedFeatureError,
)
from lora_conformance.engines.sglang_releases import ConfigRefused, Release, ServerConfig, release_for, validate
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

MODES = ("offline", "served")
CPU_BACKEND = "torch_native"  # the attention and LoRA backend SGLang can run on a host without sgl_kernel
# On cpu SGLang sizes its KV pool from mem_fraction_static of the host's free memory (two engines of
# the synthetic model held 12 GB on a 23 GB host); the suites need a few thousand tokens at most.
CPU_MAX_TOTAL_TOKENS = 32768
# SGLang's lora_eviction_policy when none is given (srt/server_args.py:2149-2155), for sharing_key.
SGLANG_DEFAULT_EVICTION = "lru"
# The largest answer read from the server (a batch with prompt logprobs is a few MiB).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

# SGLang's error texts (srt/lora/lora_manager.py, lora_registry.py, managers/tokenizer_*) -> our types.
CAPACITY_TEXTS = ("not allowed to pin all slots", "maximum number of loaded lora adapters",
                  "didn't find any lora adapters when trying to evict", "unique loras requested")
NOT_LOADED_TEXTS = ("never been loaded", "does not exist", "are not loaded")
UNSUPPORTED_TEXTS = ("doesn't support dora", "add tokens to the vocabulary", "not support")

_V = "sglang 0.5.15.post1 python/sglang/"  # where the lines below were read
# Why a capability is not declared, with the source lines (read in the installed 0.5.15.post1).
NOT_DECLARED = {
    Capability.RSLORA: f"{_V}srt/lora/lora_config.py:42-45 reads only target_modules, r, lora_alpha and use_dora "
                       "from adapter_config.json, and srt/lora/lora.py:71 sets scaling = lora_alpha / r: "
                       "use_rslora is never read",
    Capability.RANK_PATTERN: f"{_V}srt/lora/lora_config.py:42-45: rank_pattern / alpha_pattern are never read; "
                             "every module of an adapter gets r and lora_alpha (srt/lora/lora.py:71)",
    Capability.DORA: f"{_V}srt/lora/lora_manager.py:212 refuses an adapter with use_dora",
    Capability.MODULES_TO_SAVE: f"{_V}srt/lora/lora.py:_process_weight keeps layer weights, embed_tokens / lm_head "
                                "LoRA and added-token embeddings; no modules_to_save copy is read",
    Capability.LORA_BIAS: f"{_V}srt/lora/lora.py, srt/lora/layers.py: the LoRA layers compute B(A(x)) * scaling "
                          "with no lora_B bias term",
    Capability.GRAPHS: "on cpu SGLang runs no CUDA graphs (srt/server_args.py: 'Cuda graph is disabled because of "
                       "using torch native attention backend'; the plugin starts it with disable_cuda_graph): there is "
                       "no second runtime mode to compare",
    Capability.OVERLAP_LOADING: f"{_V}srt/lora/lora_overlap_loader.py:6-8 and 75 wait on the accelerator's "
                                "streams (current_stream().wait_event(event)), which a cpu-only host lacks; "
                                "srt/server_args.py:6760-6768: it exists to overlap pinned H2D copies with compute, "
                                "and a cpu run has no such copy",
    Capability.MOE: f"{_V}srt/layers/moe: MoE LoRA runs in the fused MoE runners (srt/lora/lora_moe_runners.py, "
                    "Triton / Marlin kernels); the cpu fused MoE path is sgl_kernel's, which this host cannot install",
    Capability.TENSOR_PARALLEL: "tensor parallelism on cpu needs sgl_kernel's shared-memory all-reduce "
                                "(srt/distributed, SGLANG_USE_CPU_ENGINE path); not available on a host without "
                                "sgl_kernel",
    Capability.INFLIGHT_LIFECYCLE: f"mode=offline: {_V}srt/entrypoints/engine.py:407-414 runs every Engine call with "
                                   "self.loop.run_until_complete on one event loop, so no load or unload can run "
                                   "while a generate call does (mode=served declares it)",
    Capability.EVICTION_FIFO: f"{_V}srt/lora/lora_registry.py:221-234 (lru_lora_name): past max_loaded_loras the "
                              "registry always unregisters the least recently used unpinned adapter; "
                              "lora_eviction_policy (lru|fifo, srt/lora/eviction_policy.py) only orders the device "
                              "pool's max_loras_per_batch slots, which no request can observe",
}
# On cpu the backends SGLang can run (engine-arg key -> values): the others need Triton or sgl_kernel.
_CPU_BACKENDS = {"lora_backend": (CPU_BACKEND,)}


# Set when an SGLang child process sent SIGQUIT to this process (its scheduler hit an exception).
_CHILD_FAILED = threading.Event()


def _sglang_child_failed(signum=None, frame=None) -> None:
    """SGLang's children send SIGQUIT to the process that started them when they fail, and SGLang's
    own handlers then kill that process's whole tree (srt/entrypoints/engine.py:1319-1332,
    srt/managers/tokenizer_manager.py:1833-1841 and 3128-3137). Offline, that process is the test
    run's (a pytest worker): the plugin records the signal instead, and the engine whose child died
    answers its next call with an EngineFailure that says so (the failure stays a failure; only the
    test run survives it)."""
    _CHILD_FAILED.set()


def map_sglang_error(message: str, what: str) -> EngineError:
    """One of our typed errors for an SGLang error message (SGLang answers with text only)."""
    full = f"SGLang {what}: {message}"
    low = message.lower()
    if "unique loras requested" in low:
        full += " (SGLang counts the base model, lora_path None, as one of them)"
    if any(t in low for t in CAPACITY_TEXTS):
        return CapacityError(full)
    if any(t in low for t in NOT_LOADED_TEXTS):
        return EngineError(full)
    if any(t in low for t in UNSUPPORTED_TEXTS):
        return UnsupportedFeatureError(full)
    return AdapterIncompatibleError(full)


@dataclass(frozen=True)
class SGLangArgs:
    """SGLang's own server arguments, passed on as named. Their values are checked by SGLang's
    own rules (``sglang_releases.validate``, with SGLang's messages) before it starts."""

    mode: str = arg("offline", "offline: sglang.Engine in this process; served: a launched sglang.launch_server "
                               "on 127.0.0.1, through /generate, /load_lora_adapter and /unload_lora_adapter",
                    choices=MODES)
    python: Optional[str] = arg(None, "mode=served: the interpreter that runs sglang.launch_server (default: this "
                                      "one)")
    startup_timeout: float = arg(600.0, "mode=served: seconds the server may take to answer /health", minimum=0)
    request_timeout: float = arg(300.0, "mode=served: seconds for one whole HTTP exchange", minimum=0)
    pin_memory_workaround: str = arg("auto", "auto: pin_memory is a no-op in SGLang's processes on a cpu run where "
                                             "no accelerator exists (sglang#31894), never elsewhere; off: never",
                                     choices=("auto", "off"))
    max_loras_per_batch: int = arg(8, "SGLang max_loras_per_batch, the base model counted as one (the standard "
                                      "arg, which does not count it, sets this to its value + 1)", minimum=1)
    max_loaded_loras: Optional[int] = arg(None, "SGLang max_loaded_loras (default: 2 x max_loras_per_batch with "
                                                "overlap loading, else max(16, max_loras_per_batch))")
    max_lora_rank: int = arg(64, "SGLang max_lora_rank")
    lora_target_modules: str = arg("all", "SGLang lora_target_modules, comma or space separated")
    lora_backend: Optional[str] = arg(None, "SGLang lora_backend (default: SGLang's; torch_native on cpu)")
    lora_eviction_policy: Optional[str] = arg(None, "SGLang lora_eviction_policy (default: SGLang's, lru)")
    enable_lora_overlap_loading: bool = arg(False, "SGLang enable_lora_overlap_loading")
    attention_backend: Optional[str] = arg(None, "SGLang attention_backend (default: SGLang's; torch_native on cpu)")
    mem_fraction_static: Optional[float] = arg(None, "SGLang mem_fraction_static (default: SGLang's)")
    max_total_tokens: Optional[int] = arg(None, f"SGLang max_total_tokens, the KV pool in tokens (default: "
                                                f"{CPU_MAX_TOTAL_TOKENS} on cpu, SGLang's elsewhere)", minimum=1)
    context_length: Optional[int] = arg(None, "SGLang context_length (default: the model's)")
    disable_cuda_graph: Optional[bool] = arg(None, "SGLang disable_cuda_graph (default: on for cpu)")
    disable_radix_cache: Optional[bool] = arg(None, "SGLang disable_radix_cache (default: off where the release "
                                                    "serves LoRA with the radix cache)")
    chunked_prefill_size: Optional[int] = arg(None, "SGLang chunked_prefill_size (default: SGLang's)")
    tp_size: int = arg(1, "SGLang tp_size", minimum=1)
    random_seed: int = arg(0, "SGLang random_seed")
    capabilities: Optional[str] = arg(None, "the capabilities to declare, comma separated, overriding the release "
                                            "table (for a verified deployment)", check=capability_list)


def _batch_with_base(value: str) -> dict[str, str]:
    # max_loras_per_batch means adapters per batch here as everywhere in this project; SGLang
    # counts the base model as a slot, hence + 1.
    return {"max_loras_per_batch": str(int(value) + 1)}


def installed_release() -> Optional[Release]:
    """The release row of the SGLang that ``import sglang`` would give (None: none, or unmapped)."""
    from importlib import metadata

    mod = sys.modules.get("sglang")
    try:
        version = str(getattr(mod, "__version__", "unknown")) if mod is not None else metadata.version("sglang")
        return release_for(version)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def _disable_cuda_graph(a: SGLangArgs, device: str) -> bool:
    return devices.device_type(device) == "cpu" if a.disable_cuda_graph is None else a.disable_cuda_graph


def _on_cpu(device: str) -> bool:
    return devices.device_type(device) == "cpu"


def _workaround_on(a: SGLangArgs, device: str) -> bool:
    return a.pin_memory_workaround == "auto" and workaround.applies(devices.device_type(device))


class SGLangEngine(Engine):
    name = "sglang"
    Args = SGLangArgs
    requires = ("sglang",)
    extra = "sglang"
    slow_start = True  # a server process and its warm-up
    standard_args = {
        "max_loras_per_batch": Via(_batch_with_base, "as max_loras_per_batch + 1"),
        "max_rank": Rename("max_lora_rank"),
        "eviction": Rename("lora_eviction_policy"),
        "overlap_loading": Rename("enable_lora_overlap_loading"),
        "graphs": Rename("disable_cuda_graph", invert=True),
        "prefix_cache": Rename("disable_radix_cache", invert=True),
        "tensor_parallel": Rename("tp_size"),
    }

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = self.parse_args(self.args)
        self.served = self.cfg.mode == "served"
        self.engine = None
        self._server: Optional[_Server] = None
        self._adapters: dict[str, str] = {}
        self._tokenizer = None
        self._tok_lock = threading.Lock()
        self.workaround = _workaround_on(self.cfg, device)
        if _on_cpu(device):
            # SGLang's own switch for a cpu host without sgl_kernel (srt/platforms/__init__.py); read
            # where SGLang is imported, so set before the import (offline) or in the server's environment.
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if self.served:
            self._version = self._served_version()
        else:
            try:
                import sglang
            except ImportError as exc:
                raise EngineFailure(f"engine 'sglang' needs SGLang installed ({exc}): {install_hint(type(self))} "
                                    "(cpu: ci/install_sglang_cpu.sh)") from exc
            self._version = str(getattr(sglang, "__version__", "unknown"))
        try:
            self.release = release_for(self._version)
        except ValueError as exc:
            raise EngineFailure(f"engine 'sglang': {exc}") from None
        self.is_encoder = is_encoder_only(self.model_dir)
        self.config = self._server_config(self.cfg, self.release, device)
        try:
            validate(self.release, self.config)
        except ConfigRefused as exc:
            raise UnsupportedFeatureError(f"engine 'sglang' ({self._version}): {exc}") from None
        self.kwargs = self._server_args(self.config)
        self.capabilities = self._capabilities(self.cfg, self.release, self.config, self.is_encoder, device)
        c = self.config
        self.limits = Limits(max(1, c.max_loras_per_batch - 1), c.max_loaded_loras, c.max_lora_rank)
        if self.served:
            self._server = _Server(self, self.kwargs)
            return
        devices.set_start_method_for(device)  # SGLang on accelerators needs spawn
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", workaround.ENV)}
        import multiprocessing

        before = set(multiprocessing.active_children())
        try:
            if self.workaround:
                # The scheduler and detokenizer SGLang spawns read these at their start; this
                # process (the reference's, the tests') never gets the workaround.
                os.environ.update(workaround.environment(dict(os.environ)))
            self.engine = sglang.Engine(**self.kwargs, custom_sigquit_handler=_sglang_child_failed)
            # SGLang's scheduler and detokenizer processes: a dead one means this engine cannot serve.
            self._children = [p for p in multiprocessing.active_children() if p not in before]
            self._guard_sigquit()
        except Exception as exc:  # start-up failures come in many types; all mean "cannot serve"
            self._children = [p for p in multiprocessing.active_children() if p not in before]
            self._end_leftovers()
            raise EngineFailure(f"SGLang failed to start for {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _served_version(self) -> str:
        """The SGLang version of the interpreter that will run the server."""
        python = self.cfg.python or sys.executable
        try:
            out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EngineFailure(f"engine 'sglang' (served): cannot run {python!r}: {exc}") from exc
        if out.returncode != 0:
            raise EngineFailure(f"engine 'sglang' (served): {python} has no SGLang installed: "
                                f"{out.stderr.strip().splitlines()[-1:]}")
        return out.stdout.strip()

    @classmethod
    def declared_capabilities(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str):
        """None where SGLang is not installed, its release is not mapped, or it would refuse this
        configuration: the engine's start says why."""
        release = installed_release()
        if release is None:
            return None
        config = cls._server_config(cfg, release, device)
        try:
            validate(release, config)
        except ConfigRefused:
            return None
        encoder = model_dir is not None and is_encoder_only(Path(model_dir))
        return cls._capabilities(cfg, release, config, encoder, device)

    @classmethod
    def sharing_key(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str):
        """Args that resolve to the same SGLang start are the same engine: unset values stand for
        what the plugin or SGLang fills in (the radix cache on, torch_native on cpu, lru, the
        default max_loaded_loras), so a test asking for ``prefix_cache=1``, ``eviction=lru`` or
        ``lora_backend=torch_native`` on cpu shares the engine started without them."""
        release = installed_release()
        if release is None or cfg.capabilities:
            return repr(cfg)
        c = cls._server_config(cfg, release, device)
        c = dataclasses.replace(c, lora_eviction_policy=c.lora_eviction_policy or SGLANG_DEFAULT_EVICTION)
        cpu = _on_cpu(device)
        rest = dataclasses.replace(
            cfg, max_loras_per_batch=0, max_loaded_loras=None, max_lora_rank=0, lora_target_modules="",
            lora_backend=None, lora_eviction_policy=None, enable_lora_overlap_loading=False,
            disable_radix_cache=None, chunked_prefill_size=None, tp_size=1,
            attention_backend=cfg.attention_backend or (CPU_BACKEND if cpu else None),
            max_total_tokens=cfg.max_total_tokens or (CPU_MAX_TOTAL_TOKENS if cpu else None),
            disable_cuda_graph=_disable_cuda_graph(cfg, device))
        return repr((c, rest))

    @classmethod
    def not_declared_reasons(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str):
        declared = cls.declared_capabilities(cfg, model_dir, device) or frozenset()
        if cfg.capabilities:
            return {}
        reasons = {c: why for c, why in NOT_DECLARED.items() if c not in declared}
        if cfg.mode == "served":
            reasons.pop(Capability.INFLIGHT_LIFECYCLE, None)
        if not _on_cpu(device):  # the cpu-only reasons do not hold elsewhere
            for c in (Capability.GRAPHS, Capability.OVERLAP_LOADING, Capability.MOE, Capability.TENSOR_PARALLEL):
                reasons.pop(c, None)
        return reasons

    @classmethod
    def declared_limits(cls, cfg: SGLangArgs, model_dir: Optional[Path], device: str) -> Optional[Limits]:
        release = installed_release()
        if release is None:
            return None
        c = cls._server_config(cfg, release, device)
        return Limits(max(1, c.max_loras_per_batch - 1), c.max_loaded_loras, c.max_lora_rank)

    @classmethod
    def backends(cls, device_type: str) -> Mapping[str, tuple[str, ...]]:
        """On cpu only torch_native runs (triton and csgmv are Triton kernels; ascend is an NPU's)."""
        return dict(_CPU_BACKENDS) if device_type == "cpu" else {}

    @staticmethod
    def _server_config(a: SGLangArgs, release: Release, device: str = "cpu") -> ServerConfig:
        per_batch = a.max_loras_per_batch
        overlap = a.enable_lora_overlap_loading
        # With overlap loading SGLang allows at most 2 x max_loras_per_batch loaded adapters.
        loaded = a.max_loaded_loras if a.max_loaded_loras is not None else (
            2 * per_batch if overlap else max(16, per_batch))
        backend = a.lora_backend or (CPU_BACKEND if _on_cpu(device) and CPU_BACKEND in release.lora_backends else None)
        return ServerConfig(
            max_loras_per_batch=per_batch,
            max_loaded_loras=loaded,
            max_lora_rank=a.max_lora_rank,
            lora_target_modules=tuple(a.lora_target_modules.replace(",", " ").split()),
            lora_backend=backend,
            lora_eviction_policy=a.lora_eviction_policy or None,
            enable_lora_overlap_loading=overlap,
            disable_radix_cache=not release.radix_cache if a.disable_radix_cache is None else a.disable_radix_cache,
            chunked_prefill_size=a.chunked_prefill_size,
            tp_size=a.tp_size,
        )

    def _server_args(self, c: ServerConfig) -> dict[str, Any]:
        a = self.cfg
        kwargs: dict[str, Any] = dict(
            model_path=str(self.model_dir),
            enable_lora=True,
            max_loras_per_batch=c.max_loras_per_batch,
            max_loaded_loras=c.max_loaded_loras,
            max_lora_rank=c.max_lora_rank,
            lora_target_modules=list(c.lora_target_modules),
            device=devices.device_type(self.device),
            dtype=self.dtype,
            disable_cuda_graph=_disable_cuda_graph(a, self.device),
            random_seed=a.random_seed,
        )
        attention = a.attention_backend or (CPU_BACKEND if _on_cpu(self.device) else None)
        optional = {
            "lora_backend": c.lora_backend,
            "lora_eviction_policy": c.lora_eviction_policy,
            "enable_lora_overlap_loading": c.enable_lora_overlap_loading or None,
            "disable_radix_cache": c.disable_radix_cache or None,
            "chunked_prefill_size": c.chunked_prefill_size,
            "tp_size": c.tp_size if c.tp_size != 1 else None,
            "attention_backend": attention,
            "mem_fraction_static": a.mem_fraction_static,
            "max_total_tokens": a.max_total_tokens or (CPU_MAX_TOTAL_TOKENS if _on_cpu(self.device) else None),
            "sleep_on_idle": True if _on_cpu(self.device) else None,
            "skip_server_warmup": True if self.served and _on_cpu(self.device) else None,
            "context_length": a.context_length,
            "is_embedding": True if self.is_encoder else None,
            "base_gpu_id": int(self.device.split(":", 1)[1]) if ":" in self.device else None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs

    @staticmethod
    def _capabilities(a: SGLangArgs, release: Release, c: ServerConfig, is_encoder: bool, device: str) -> frozenset:
        return frozenset(SGLangEngine._capability_set(a, release, c, is_encoder, device))

    @staticmethod
    def _capability_set(a: SGLangArgs, release: Release, c: ServerConfig, is_encoder: bool,
                        device: str) -> set[Capability]:
        # Past max_loaded_loras SGLang's registry unregisters the least recently used unpinned adapter
        # whatever lora_eviction_policy says (that policy orders the device pool's slots): lru only.
        evicts = {Capability.EVICTION_LRU} if release.beyond_max_loaded == "evict" else set()
        if a.capabilities:
            return {Capability.parse(x) for x in a.capabilities.replace(",", " ").split()}
        if is_encoder:  # encode takes one lora_path per text (a mixed batch), as generate does
            return {Capability.EMBEDDINGS, Capability.DYNAMIC_LOADING, Capability.MIXED_BATCH} | evicts
        cpu = _on_cpu(device)
        caps = {Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.PROMPT_LOGPROBS,
                Capability.CHUNKED_PREFILL} | evicts
        targets = set(c.lora_target_modules)
        flags = {
            Capability.PINNING: release.pinning,
            Capability.MAX_LOADED: release.beyond_max_loaded == "evict",
            Capability.OVERLAP_LOADING: c.enable_lora_overlap_loading and not cpu,
            Capability.PREFIX_CACHE: release.radix_cache and not c.disable_radix_cache,
            Capability.GRAPHS: not _disable_cuda_graph(a, device),
            Capability.EMBED_TOKENS: release.embed_tokens and bool(targets & {"all", "embed_tokens"}),
            Capability.LM_HEAD: release.lm_head and bool(targets & {"all", "lm_head"}),
            Capability.MOE: release.moe and not cpu,
            Capability.TENSOR_PARALLEL: not cpu,
            Capability.INFLIGHT_LIFECYCLE: a.mode == "served",
        }
        return caps | {cap for cap, on in flags.items() if on}

    # ---- adapters -------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        if name in self._adapters:
            self.unload_adapter(name)  # SGLang refuses a loaded name ("already loaded")
        if self.served:
            out = self._server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path),
                                                           "pinned": bool(pinned)}, update=True)
        else:
            out = self._call("load_lora_adapter", name, str(path), pinned)
        self._check_update(out, f"loading adapter {name!r} from {path}")
        self._adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoadedError(name, self.list_adapters())
        if self.served:
            out = self._server.post("/unload_lora_adapter", {"lora_name": name}, update=True)
        else:
            out = self._call("unload_lora_adapter", name)
        try:
            self._check_update(out, f"unloading adapter {name!r}")
        except EngineError as exc:
            # SGLang (0.5.8+) unregisters the least recently used adapter past max_loaded_loras and
            # loads it again when a request names it; an explicit unload of it then answers
            # "LoRA with name X does not exist". Ours to forget: no request of ours names it again.
            if "does not exist" not in str(exc):
                raise
        del self._adapters[name]

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def engine_adapters(self) -> Optional[list[str]]:
        """The adapters SGLang's tokenizer-side registry holds (``LoRARegistry``; served: the
        ``/v1/models`` entries with a parent). Past max_loaded_loras SGLang unregisters the least
        recently used one (it loads it again when a request names it)."""
        if self.served:
            body = self._server.request("GET", "/v1/models")
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list):
                raise EngineFailure(f"SGLang /v1/models: expected an object with a 'data' list, got {str(body)[:300]}")
            return sorted(m["id"] for m in data if isinstance(m, dict) and m.get("parent") and "id" in m)
        if self.engine is None:
            raise EngineFailure("SGLang engine is closed")
        registry = getattr(getattr(self.engine, "tokenizer_manager", None), "lora_registry", None)
        if registry is None:
            return None
        return sorted(registry.get_all_adapters())

    def resident_adapters(self) -> Optional[list[str]]:
        """The adapters SGLang holds within max_loaded_loras: its registry (what it unregisters past
        the limit is what an eviction policy decides)."""
        return self.engine_adapters()

    def reset_prefix_cache(self) -> bool:
        """SGLang's own flush of the radix cache (``Engine.flush_cache`` / ``POST /flush_cache``);
        it refuses while requests run, as none do between tests."""
        if self.served:
            try:
                self._server.request("POST", "/flush_cache")
                return True
            except EngineError:
                return False
        if self.engine is None or not hasattr(self.engine, "flush_cache"):
            return False
        out = self._call("flush_cache")
        return bool(out.get("success", True) if isinstance(out, dict) else getattr(out, "success", True))

    def _check_update(self, out: Any, what: str) -> None:
        """SGLang answers LoRA updates with an object (success, error_message), not an exception."""
        ok = out.get("success", True) if isinstance(out, dict) else getattr(out, "success", True)
        if ok:
            return
        msg = (out.get("error_message") if isinstance(out, dict) else getattr(out, "error_message", "")) or ""
        raise map_sglang_error(msg, what)

    # ---- generation -----------------------------------------------------------------

    def _generate_fields(self, requests: Sequence[GenerationRequest]) -> dict[str, Any]:
        return dict(
            sampling_params=[{"temperature": 0.0, "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos}
                             for r in requests],
            lora_path=[r.adapter for r in requests],
            return_logprob=True,
            top_logprobs_num=[r.top_k for r in requests],
            logprob_start_len=[0 if r.prompt_logprobs else -1 for r in requests],
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.require_loaded(requests)
        if not requests:
            return []
        if self.served:
            outs = self._server.post("/generate", {"text": [r.prompt for r in requests],
                                                   **self._generate_fields(requests)})
        else:
            outs = self._call("generate", prompt=[r.prompt for r in requests], **self._generate_fields(requests))
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != len(requests):
            raise EngineFailure(f"SGLang returned {len(outs) if isinstance(outs, list) else type(outs).__name__} "
                                f"outputs for {len(requests)} requests")
        return [self._result(r, o) for r, o in zip(requests, outs)]

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestHandle:
        """mode=served: each request streams from ``/generate`` on a thread of its own, so the handle
        knows when its first token came; adapters load and unload meanwhile through the server,
        whose registry drains a name before unloading it (the plugin does not wait in its place)."""
        if Capability.INFLIGHT_LIFECYCLE not in self.capabilities or not self.served:
            return super().submit(requests)
        self.require_loaded(requests)
        return FuturesHandle.on_threads(self._one_streamed, requests)

    def _one_streamed(self, req: GenerationRequest, started: threading.Event) -> GenerationResult:
        body = {"text": req.prompt, "stream": True,
                **{k: v[0] if isinstance(v, list) else v for k, v in self._generate_fields([req]).items()}}
        last = None
        try:
            for chunk in self._server.stream("/generate", body):
                if "error" in chunk:
                    raise map_sglang_error(str((chunk.get("error") or {}).get("message", chunk)), "generate (stream)")
                last = chunk
                if chunk.get("output_ids") or (chunk.get("meta_info") or {}).get("completion_tokens"):
                    started.set()
        finally:
            started.set()
        if last is None:
            raise EngineFailure("SGLang's streamed /generate ended without an answer")
        return self._result(req, last)

    @staticmethod
    def _top(entries: Optional[Sequence], k: int) -> TopK:
        return trim_topk({int(t[1]): float(t[0]) for t in entries or () if t[0] is not None}, k)

    def _result(self, req: GenerationRequest, out: Mapping[str, Any]) -> GenerationResult:
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids")
        if ids is None:
            ids = [int(t[1]) for t in meta.get("output_token_logprobs") or ()]
        ids = [int(t) for t in ids]
        steps = [self._top(e, req.top_k) for e in meta.get("output_top_logprobs") or ()]
        prompt_ids = [int(t[1]) for t in meta.get("input_token_logprobs") or ()] if req.prompt_logprobs else []
        if not prompt_ids:
            prompt_ids = list(self._tok()(req.prompt)["input_ids"])
        prompt_lps = None
        if req.prompt_logprobs:
            raw = list(meta.get("input_top_logprobs") or ())
            prompt_lps = [self._top(e, req.top_k) for e in raw[1:]]  # raw[0] is None
        cached = meta.get("cached_tokens")
        return GenerationResult(token_ids=ids, text=out.get("text", ""), logprobs=steps,
                                prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lps,
                                cached_tokens=None if cached is None else int(cached))

    def embed(self, texts: Sequence[str], adapter: Optional[str] = None) -> list[list[float]]:
        if not self.is_encoder:
            raise UnsupportedFeatureError(f"engine 'sglang': {self.model_dir} is not an embedding model")
        paths = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * len(texts)
        for a in paths:
            if a is not None and a not in self._adapters:
                raise AdapterNotLoadedError(a, self.list_adapters())
        if self.served:
            outs = self._server.post("/encode", {"text": list(texts), "lora_path": paths})
        else:
            outs = self._call("encode", prompt=list(texts), lora_path=paths)
        if isinstance(outs, dict):
            outs = [outs]
        vectors = []
        for o in outs:
            v = [float(x) for x in o["embedding"]]
            norm = sum(x * x for x in v) ** 0.5 or 1.0
            vectors.append([x / norm for x in v])  # pooling is SGLang's (model config); the norm is ours
        return vectors

    # ---- plumbing ---------------------------------------------------------------------

    def _guard_sigquit(self) -> None:
        """Offline: SGLang's tokenizer manager installs, on its event loop, a SIGQUIT handler that
        kills this process's tree when a child fails; put ``_sglang_child_failed`` in its place
        (and stop the loop, so the call waiting for the dead scheduler returns)."""
        tm = getattr(self.engine, "tokenizer_manager", None)
        if tm is None or not hasattr(tm, "auto_create_handle_loop"):
            return  # not SGLang's Engine (the stand-in)
        if threading.current_thread() is not threading.main_thread():
            return  # SGLang installs no handler off the main thread either
        loop = self.engine.loop

        async def create_handle_loop():  # on the Engine's loop, as SGLang's own first request would
            tm.auto_create_handle_loop()

        loop.run_until_complete(create_handle_loop())
        if tm.event_loop is not loop:
            return  # not the layout this guard was written for (0.5.15.post1): leave SGLang's handler

        def failed():
            # Any SGLang child in this process may have sent it (another engine's too): stop this
            # engine's call only once one of its own processes has exited (checked for 5 s).
            _sglang_child_failed()
            tries = [0]

            def check():
                if self._dead_children():
                    if loop.is_running():
                        loop.stop()
                elif tries[0] < 50:
                    tries[0] += 1
                    loop.call_later(0.1, check)

            loop.call_soon(check)

        loop.remove_signal_handler(signal.SIGQUIT)
        loop.add_signal_handler(signal.SIGQUIT, failed)

    def _call(self, method: str, *args, **kwargs):
        engine = getattr(self, "engine", None)
        if engine is None:
            raise EngineFailure("SGLang engine is closed")
        dead = self._dead_children()
        if dead:
            raise EngineFailure(f"SGLang's {dead} process died earlier (it sent SIGQUIT; its traceback is in the "
                                "captured output of the test that met it); the engine cannot serve")
        try:
            return getattr(engine, method)(*args, **kwargs)
        except EngineError:
            raise
        except Exception as exc:
            dead = self._dead_children(wait=2.0) if _CHILD_FAILED.is_set() else ""
            if dead:
                raise EngineFailure(f"SGLang {method}: its {dead} process died (SIGQUIT; traceback in the captured "
                                    f"output): {type(exc).__name__}: {exc}") from exc
            return self._raise_typed(method, exc)

    def _dead_children(self, wait: float = 0.0) -> str:
        """The names of this engine's SGLang processes that have exited ('' when none has)."""
        deadline = time.monotonic() + wait
        while True:
            dead = [p.name for p in getattr(self, "_children", ()) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return ", ".join(dead)
            time.sleep(0.1)

    @staticmethod
    def _raise_typed(method: str, exc: Exception):
        if isinstance(exc, (ValueError, TypeError)):
            text = str(exc).lower()
            if "lora" in text or "adapter" in text:
                raise map_sglang_error(str(exc), method) from exc
            raise EngineError(f"SGLang {method}: {type(exc).__name__}: {exc}") from exc
        raise EngineFailure(f"SGLang {method}: {type(exc).__name__}: {exc}") from exc

    def _tok(self):
        # Called from submit's threads too; transformers' lazy imports are not thread-safe.
        with self._tok_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            server.stop()
        if engine is not None:
            try:
                if hasattr(engine, "tokenizer_manager"):
                    self._end_own_processes(engine)
                else:
                    engine.shutdown()  # not SGLang's Engine (the stand-in)
            except Exception:
                pass  # already gone

    # SGLang's Engine.shutdown() ends every child process of the host process
    # (srt/entrypoints/engine.py:925: kill_process_tree(os.getpid(), include_parent=False)), so closing
    # one offline engine SIGKILLs the scheduler and detokenizer of every other engine in that process,
    # and of one starting meanwhile (its start then fails: "Rank 0 scheduler died during
    # initialization"). A certification keeps several engines per worker (settings the suites ask for,
    # the prompt-logprobs probe), and closes retired ones on a thread: the plugin ends this engine's own
    # processes instead, as shutdown() does for all (its watchdog stopped first, its RPC socket closed).
    SHUTDOWN_NOTE = ("the plugin ends this engine's own scheduler and detokenizer: SGLang's Engine.shutdown() "
                     "SIGKILLs every child of the host process, other engines' included "
                     "(srt/entrypoints/engine.py:925)")

    def _end_leftovers(self) -> None:
        """After a failed start: end the processes it left (a detokenizer beside a dead scheduler)."""
        for child in self._children:
            if child.exitcode is None:
                child.kill()
            child.join(timeout=5)

    def _end_own_processes(self, engine) -> None:
        tm = getattr(engine, "tokenizer_manager", None)
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # else it reports the processes ended below as a crash (SIGQUIT)
        rpc = getattr(engine, "send_to_rpc", None)
        if rpc is not None:
            rpc.close(linger=0)
            engine.send_to_rpc = None
        import psutil  # an SGLang dependency

        own = list(getattr(self, "_children", ()))
        descendants = []  # processes SGLang's own processes started, if any
        for child in own:
            try:
                descendants += psutil.Process(child.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
        for proc in descendants:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        for child in own:
            if child.exitcode is None:
                child.kill()  # SIGKILL, as shutdown() sends
        for child in own:
            child.join(timeout=60)  # reaped by multiprocessing, so exitcode tells the end
        psutil.wait_procs(descendants, timeout=60)

    def version(self) -> str:
        base = f"sglang {self._version}"
        return f"{base} + {workaround.LABEL}" if self.workaround else base

    # Why a setting of ours differs from SGLang's default.
    WHY = {
        "attention_backend": "SGLang's cpu default, intel_amx, needs sgl_kernel's CPU ops, which a host without "
                             "sgl_kernel lacks; torch_native is SGLang's own PyTorch attention",
        "lora_backend": "SGLang's default, csgmv, is Triton kernels, which do not run on cpu; torch_native is "
                        "SGLang's own PyTorch LoRA backend",
        "max_loras_per_batch": "the suites' standard max_loras_per_batch + 1 (SGLang counts the base model)",
        "max_loaded_loras": "given explicitly: SGLang's default is unbounded (None)",
        "max_lora_rank": "given explicitly, so adapters load at run time without --lora-paths",
        "lora_target_modules": "given explicitly ('all'), so adapters load at run time without --lora-paths",
        "enable_lora": "LoRA on, the feature under test",
        "random_seed": "a fixed seed (greedy decoding does not use it)",
        "disable_cuda_graph": "no CUDA graphs on cpu",
        "sleep_on_idle": "an idle SGLang scheduler otherwise polls (and checks its pools) without pause, a whole "
                         "core each on a cpu host where the reference and other engines need the cores",
        "skip_server_warmup": "SGLang's warm-up polls its own /model_info at most 120 times and then kills its own "
                              "process tree (srt/entrypoints/http_server.py:1993-2018): on a loaded cpu host a server "
                              "came up later than that and killed itself during start-up (exit -9); the plugin waits "
                              "for /health itself (startup_timeout) and the first request does the warm-up's work",
        "max_total_tokens": "on cpu SGLang sizes the KV pool from the host's free memory (mem_fraction_static): two "
                            "engines of the synthetic model held 12 GB of a 23 GB host shared with other work; the "
                            "suites' requests need a few thousand tokens",
    }

    def settings(self) -> dict:
        """SGLang's effective server args for LoRA and the run (read back from SGLang where it
        tells), the environment changes the plugin made, and each of our args that differs from
        SGLang's default, with the reason."""
        effective: dict[str, Any] = {"mode": self.cfg.mode}
        effective.update({k: (" ".join(v) if isinstance(v, list) else v) for k, v in self.kwargs.items()
                          if k != "model_path"})
        if not self.served:
            effective["close"] = self.SHUTDOWN_NOTE
            effective["custom_sigquit_handler"] = ("the plugin's: a failed SGLang child makes the engine's next call an "
                                                   "EngineFailure instead of killing the test process")
        read_back = self._read_back()
        effective.update(read_back)
        effective["SGLANG_USE_CPU_ENGINE"] = os.environ.get("SGLANG_USE_CPU_ENGINE") if _on_cpu(self.device) else None
        effective["pin_memory workaround"] = (f"on: pin_memory is a no-op in SGLang's processes, no accelerator on "
                                              f"this host ({workaround.LINK})" if self.workaround else "off")
        defaults = _sglang_defaults()
        differs = {}
        for k, v in self.kwargs.items():
            if k in ("model_path", "device", "dtype", "is_embedding", "base_gpu_id"):
                continue
            default = defaults.get(k, "?")
            shown = " ".join(v) if isinstance(v, list) else v
            if default != v and not (isinstance(default, (set, list, tuple)) and sorted(default) == sorted(v)):
                differs[k] = {"ours": shown, "engine_default": default if not isinstance(default, set) else
                              sorted(default), "why": self.WHY.get(k, "")}
        return {"effective": {k: v for k, v in effective.items() if v is not None},
                "differs_from_engine_default": differs}

    def _read_back(self) -> dict:
        keys = ("attention_backend", "lora_backend", "sampling_backend", "chunked_prefill_size", "max_running_requests",
                "disable_radix_cache", "lora_eviction_policy", "max_loaded_loras", "mem_fraction_static",
                "context_length", "schedule_policy")
        try:
            if self.served:
                info = self._server.request("GET", "/server_info")
            else:
                info = vars(self.engine.server_args) if self.engine is not None else {}
        except Exception:  # noqa: BLE001 - the settings table is informative; the run goes on
            return {}
        if not isinstance(info, dict):
            return {}
        return {f"{k} (SGLang's)": info[k] for k in keys if k in info and not isinstance(info[k], (dict, list))}


def _sglang_defaults() -> dict:
    """ServerArgs' field defaults of the installed SGLang ({} where it cannot be imported here)."""
    try:
        import dataclasses as dc

        from sglang.srt.server_args import ServerArgs
    except Exception:  # noqa: BLE001 - not installed here (served from another interpreter)
        return {}
    return {f.name: f.default for f in dc.fields(ServerArgs) if f.default is not dc.MISSING}


def _cli(kwargs: Mapping[str, Any]) -> list[str]:
    """``sglang.launch_server``'s argument list for the same server args ``sglang.Engine`` takes."""
    argv: list[str] = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                argv.append(flag)
        elif isinstance(v, (list, tuple)):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


def _free_port() -> int:
    """A free loopback port below 55536: SGLang derives its gRPC port as --port + 10000 and refuses a
    start where that passes 65535, even with gRPC off (srt/server_args.py:2997-3005)."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise EngineFailure("engine 'sglang' (served): no free port in 20000-55535 on 127.0.0.1")


class _Server(served.ServerProcess):
    """``python -m sglang.launch_server`` on 127.0.0.1 (``served.ServerProcess``: its session, its log,
    HTTP to it), SGLang's error texts mapped to our types."""

    def __init__(self, engine: SGLangEngine, kwargs: Mapping[str, Any]):
        cfg = engine.cfg
        port = _free_port()
        python = cfg.python or sys.executable
        env = dict(os.environ)
        if _on_cpu(engine.device):
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if engine.workaround:
            env = workaround.environment(env)
        super().__init__([python, "-m", "sglang.launch_server", *_cli(kwargs), "--host", "127.0.0.1",
                          "--port", str(port)], port, label="SGLang server", owner="engine 'sglang'",
                         log_prefix="lora-conformance-sglang-", startup_timeout=cfg.startup_timeout,
                         request_timeout=cfg.request_timeout, max_bytes=MAX_RESPONSE_BYTES, env=env)

    def error(self, parsed: Any, what: str) -> EngineError:
        return map_sglang_error(str(served.error_message(parsed)), what)

    def post(self, route: str, body: Any, update: bool = False) -> Any:
        """POST a JSON body. ``update``: SGLang answers LoRA updates with 400 and a body
        ``{"success": false, "error_message": ...}``, which is returned for the caller to read."""
        status, parsed = self.exchange("POST", route, body)
        if update and status >= 400 and isinstance(parsed, dict) and "success" in parsed:
            return parsed
        return self.checked(status, parsed, f"POST {route}")
