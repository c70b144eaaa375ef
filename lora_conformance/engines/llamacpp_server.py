"""The ``llamacpp`` engine, ``mode=served``: llama.cpp's own ``llama-server``, as its users serve it.

Read in, and built from, the llama.cpp that llama-cpp-python 0.3.36 vendors (ggml-org/llama.cpp@0c1e57098;
``ci/install_llama_server.sh``); ``tools/server/...`` and ``common/...`` below are paths in that tree.

What the plugin does:

* Our converters (``llamacpp_convert``) write the base model and every adapter as GGUF, as in the
  offline mode. The plugin starts ``llama-server -m base.gguf --lora a.gguf --lora b.gguf ...
  --lora-init-without-apply --parallel N --cont-batching`` on 127.0.0.1 on a free port, waits for
  ``GET /health`` under a deadline, and stops the server's process group (``served.ServerProcess``).
* Every request is one ``POST /completion`` with the prompt as token ids (our tokenizer), greedy
  (``temperature`` 0), ``n_probs`` = top_k with pre-sampling logprobs (``post_sampling_probs``
  false: ``tools/server/server-context.cpp`` populate_token_probs -> ``get_token_probabilities``,
  the softmax of the full logits), ``return_tokens``, and its adapter as ``"lora": [{"id": i,
  "scale": 1.0}]`` with every other loaded adapter at scale 0 (for the base: all at 0). The scales
  are always sent in full because of a finding (``FINDINGS``): ``--lora-init-without-apply`` leaves
  the global scales at 1.0, and a request without ``lora`` (or with ``[]``) is served with them
  (``server-context.cpp:1702-1703``), though the server's README (lines 603 and 1203) says such
  adapters are at scale 0. The requests of one
  ``generate`` call are sent together, one thread each, so the server's parallel slots run them
  at once: which requests it decodes in one forward is the server's business (it batches slots
  with equal LoRA sets, ``server-context.cpp:419-425`` ``can_batch_with``, and runs the others in
  turn); each request gets its own adapter while the others run, which is what ``mixed_batch``
  and the in-flight features judge.
* Adapters: ``llama-server`` reads adapters only at start (``--lora``); ``POST /lora-adapters``
  sets the global scales of those adapters and nothing else (``server-context.cpp:2693-2704``,
  ``construct_lora_list`` of the adapters loaded at start). So a load, unload or reload that
  changes the adapter set restarts the server with the new ``--lora`` list, after the requests
  running on the old one have finished (an unload or reload *waits* for them, as the interface
  allows). A failed start (llama.cpp refusing an adapter) puts the previous set back and says
  why. ``engine_adapters`` asks ``GET /lora-adapters`` and maps its paths back to names.
* Prefix cache: ``cache_prompt`` (the server's default, per request): each slot reuses the KV of
  its previous prompt's common prefix, and clears it when the request's LoRA set differs
  (``server-context.cpp:1689-1700``). The server's host prompt cache (``--cache-ram``, 8192 MiB by
  default) is off unless ``cache_ram`` turns it on: it does not key its entries by adapter and
  hands one adapter's KV to another's request (``FINDINGS["cache_ram"]``; the report's settings
  list it among ours that differ from the server's defaults; ``--engine-arg cache_ram=8192``
  certifies the server's default). ``prefix_cache=0`` sends ``cache_prompt: false``.
  ``cached_tokens`` comes from the answer's ``timings.cache_n``.
* Chunked prefill: ``chunked_prefill_size=N`` starts the server with ``--batch-size N
  --ubatch-size N``: a prompt longer than N is prefilled over several server steps of N tokens
  (``server-context.cpp`` update_slots: a slot adds prompt tokens until ``n_batch``), each decode
  reading the KV the earlier chunks wrote.
* The encoder and MoE bases: see ``llamacpp_convert`` (what is converted) and ``NOT_DECLARED``.

Not declared, with llama.cpp's own evidence: ``NOT_DECLARED`` below (the report shows it).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance import devices
from lora_conformance.engines import served
from lora_conformance.engines._hf_common import load_tokenizer, read_adapter_info, trim_topk
from lora_conformance.engines.args import Ignore, Rename, arg
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    Engine,
    EngineError,
    EngineFailure,
    FuturesHandle,
    Limits,
    RequestHandle,
    UnsupportedFeatureError,
    only,
)
from lora_conformance.types import GenerationRequest, GenerationResult

LLAMA_CPP = "ggml-org/llama.cpp@0c1e57098 (vendored by llama-cpp-python 0.3.36)"
_S = "tools/server/"
KV_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # --cache-type-k / -v
DEFAULT_BIN = Path.home() / ".cache" / "lora-conformance" / "llama-server" / "bin" / "llama-server"
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
SERVER_CACHE_RAM = 8192  # llama-server's default --cache-ram (MiB), common/common.h cache_ram_mib

# Why a capability is not declared: llama.cpp's source (the version above) or docs.
NOT_DECLARED = {
    Capability.PROMPT_LOGPROBS: f"{_S}server-context.cpp:1945-2000 (populate_token_probs) gives n_probs for "
                                f"generated tokens only; no route returns the prompt positions' distributions "
                                f"({_S}server-common.cpp:1050-1053: the OpenAI route refuses echo, 'Only no echo "
                                "is supported')",
    Capability.MAX_LOADED: f"every adapter is loaded at start (--lora) and held until the server exits "
                           f"({_S}README.md:94,243 and 1199-1234); there is no bounded adapter cache and no eviction",
    Capability.EVICTION_LRU: "no bounded adapter cache: nothing is evicted (see max_loaded)",
    Capability.EVICTION_FIFO: "no bounded adapter cache: nothing is evicted (see max_loaded)",
    Capability.PINNING: "no bounded adapter cache: nothing to pin (see max_loaded)",
    Capability.OVERLAP_LOADING: "adapters load at start only (common/common.cpp common_init_from_params: "
                                "llama_adapter_lora_init for each --lora before the server listens); no loading "
                                "runs beside a batch",
    Capability.GRAPHS: "the CPU backend has no graph capture (ggml-cpu computes each graph directly); there is no "
                       "second runtime mode to compare",
    Capability.TENSOR_PARALLEL: "no tensor parallelism on the CPU backend (--split-mode splits over GPUs only, "
                                "common/arg.cpp --split-mode)",
    Capability.DORA: "GGUF LoRA holds lora_a / lora_b only (src/llama-adapter.cpp llama_adapter_lora_init_impl "
                     "reads '.lora_a' / '.lora_b' tensors); no DoRA magnitude",
    Capability.MODULES_TO_SAVE: "GGUF LoRA holds lora_a / lora_b only (src/llama-adapter.cpp); no full module copies",
    Capability.LORA_BIAS: "GGUF LoRA holds lora_a / lora_b only (src/llama-adapter.cpp); no LoRA bias",
}
# What llama-server does otherwise than its documentation says (docs/llamacpp.md; tested in
# tests/test_engine_llamacpp_server.py).
FINDINGS = {
    "init_without_apply": f"--lora-init-without-apply does not set the adapters' scales to 0: common/common.cpp:1412-1414 "
                          "only skips applying them to the context at start, params.lora_adapters keep scale 1.0, GET "
                          f"/lora-adapters reports 1.0, and a /completion without 'lora' or with 'lora': [] is served "
                          f"with every adapter at 1.0 ({_S}server-context.cpp:1702-1703); {_S}README.md:1203 says the "
                          "flag initialises all adapters' scale to 0, and README.md:603 that an adapter missing from "
                          "'lora' defaults to 0.0",
    "cache_ram": f"the host prompt cache (--cache-ram, on by default) keeps a prompt's KV state with its tokens only "
                 f"({_S}server-task.h:566-586 struct server_prompt: tokens and checkpoints, no LoRA); "
                 f"{_S}server-task.cpp:1793-1830 server_prompt_cache::load restores the entry with the longest common "
                 f"prefix, and {_S}server-context.cpp:1617-1634 (get_available_slot) loads it into the slot before "
                 f"launch_slot_with_task ({_S}server-context.cpp:1689-1700) compares the task's LoRA with the slot's "
                 "previous one, not with the restored state's: a request can decode on KV another adapter wrote "
                 "(ci/repro/llama_server_lora_findings.py cache_ram: 3 and 1 of 135 requests wrong in two runs, each "
                 "with cached tokens > 0; 0 of 135 with --cache-ram 0)",
}
ENCODER_NOT_DECLARED = {
    Capability.MIXED_BATCH: f"an embedding request takes no per-request adapter: {_S}server-context.cpp:5447-5461 "
                            "builds the embedding tasks with tokens and embd_normalize only (no params.lora), so "
                            "every slot uses the global scales of POST /lora-adapters "
                            f"({_S}server-context.cpp:1703); one adapter at a time",
}


@dataclass(frozen=True)
class LlamaServerArgs:
    mode: str = arg("served", "served: llama.cpp's llama-server (this module); offline: llama-cpp-python in "
                              "this process", choices=("offline", "served"))
    server_bin: Optional[str] = arg(None, "the llama-server binary (default: $LLAMA_SERVER_BIN, then "
                                          f"{DEFAULT_BIN}, then PATH; ci/install_llama_server.sh builds it)")
    parallel: int = arg(4, "llama-server --parallel: slots serving requests at once", minimum=1)
    n_ctx: int = arg(512, "context per slot: prompt + generated tokens of one request (-c is n_ctx * parallel)",
                     minimum=16)
    n_threads: Optional[int] = arg(None, "llama-server --threads (default: torch's intra-op threads)", minimum=1)
    prefix_cache: bool = arg(True, "cache_prompt per request and --cache-ram (llama-server's default: on)")
    cache_ram: int = arg(0, "llama-server --cache-ram MiB, its host prompt cache (default 0: off, because its "
                            "entries are keyed by tokens only, FINDINGS['cache_ram']; 8192 is the server's own "
                            "default)", minimum=-1)
    kv_unified: Optional[bool] = arg(None, "llama-server --kv-unified / --no-kv-unified: one KV buffer shared by all "
                                           "slots (default: the server's own choice)")
    chunked_prefill_size: int = arg(0, "--batch-size and --ubatch-size (0: llama-server's defaults, 2048 / 512)",
                                    minimum=0)
    gguf_cache: Optional[str] = arg(None, "where converted GGUF files are kept (default: beside the model's cache)")
    max_rank: int = arg(256, "the largest adapter rank accepted (llama.cpp has no limit of its own)", minimum=1)
    extra_bufts: bool = arg(True, "llama.cpp's extra buffer types (repacked, AMX) for quantised weights; off: "
                                  "llama-server --no-repack (the offline mode's use_extra_bufts)")
    flash_attn: Optional[str] = arg(None, "llama.cpp's flash attention: auto, on or off (default: off in float32, "
                                          "llama.cpp's auto otherwise)", choices=("auto", "on", "off"))
    startup_timeout: float = arg(120.0, "seconds the server may take to answer /health", minimum=1)
    request_timeout: float = arg(300.0, "seconds for one whole HTTP exchange", minimum=1)


STANDARD_ARGS = {
    "max_loras_per_batch": Rename("parallel"),
    "max_loaded_loras": Ignore("no bound: every adapter is loaded at start and held"),
    "max_rank": Rename("max_rank"),
    "eviction": only("llamacpp", "eviction", "none"),
    "prefix_cache": Rename("prefix_cache"),
    "chunked_prefill_size": Rename("chunked_prefill_size"),
    "overlap_loading": only("llamacpp", "overlap_loading", "0"),
    "graphs": only("llamacpp", "graphs", "0"),
    "tensor_parallel": only("llamacpp", "tensor_parallel", "1"),
}

DECODER = frozenset({Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.INFLIGHT_LIFECYCLE,
                     Capability.CHUNKED_PREFILL, Capability.RSLORA, Capability.RANK_PATTERN,
                     Capability.EMBED_TOKENS, Capability.LM_HEAD})


def model_support(model_dir: Optional[Path]) -> Optional[str]:
    """'decoder', 'moe' or 'encoder' for a base our converters write for llama.cpp; None otherwise."""
    if model_dir is None:
        return "decoder"
    from lora_conformance.checkpoints import model_kind, read_model_config
    from lora_conformance.engines.llamacpp_convert import ARCHES

    try:
        model_type = read_model_config(model_dir).get("model_type")
    except (OSError, ValueError):
        return None
    if model_type not in ARCHES:
        return None
    kind = model_kind(Path(model_dir))
    return kind if kind in ("decoder", "moe", "encoder") else None


def capabilities(cfg: LlamaServerArgs, model_dir: Optional[Path]) -> Optional[frozenset]:
    kind = model_support(model_dir)
    if kind is None:
        return None
    if kind == "encoder":
        return frozenset({Capability.EMBEDDINGS, Capability.DYNAMIC_LOADING, Capability.RSLORA,
                          Capability.RANK_PATTERN})
    caps = set(DECODER)
    if cfg.prefix_cache:
        caps.add(Capability.PREFIX_CACHE)
    if kind == "moe":
        caps.add(Capability.MOE)
    return frozenset(caps)


def not_declared(cfg: LlamaServerArgs, model_dir: Optional[Path]) -> dict:
    declared = capabilities(cfg, model_dir) or frozenset()
    reasons = {c: why for c, why in NOT_DECLARED.items() if c not in declared}
    if model_support(model_dir) == "encoder":
        reasons.update(ENCODER_NOT_DECLARED)
    if not cfg.prefix_cache:
        reasons[Capability.PREFIX_CACHE] = "turned off by this run's prefix_cache=0"
    return reasons


def limits(cfg: LlamaServerArgs) -> Limits:
    # max_loras_per_batch: the adapters served at once, one per parallel slot.
    return Limits(max_loras_per_batch=cfg.parallel, max_loaded_loras=1024, max_rank=cfg.max_rank)


def find_server(cfg: LlamaServerArgs) -> Path:
    """The llama-server binary: the engine arg, $LLAMA_SERVER_BIN, the install script's location, PATH."""
    for named, where in ((cfg.server_bin, "--engine-arg server_bin"), (os.environ.get("LLAMA_SERVER_BIN"),
                                                                         "$LLAMA_SERVER_BIN")):
        if named:  # named, so no other binary is taken in its place
            path = Path(named).expanduser()
            if path.is_file() and os.access(path, os.X_OK):
                return path
            raise EngineFailure(f"engine 'llamacpp' (mode=served): {where}={named} is not an executable file; build "
                                "llama-server with ci/install_llama_server.sh")
    tried = []
    for candidate, where in ((str(DEFAULT_BIN), "the default location"), (shutil.which("llama-server"), "PATH")):
        if not candidate:
            continue
        path = Path(candidate)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        tried.append(f"{where}: {candidate}")
    raise EngineFailure("engine 'llamacpp' (mode=served) needs llama.cpp's llama-server: build it with "
                        "ci/install_llama_server.sh, or name it with $LLAMA_SERVER_BIN or --engine-arg server_bin=PATH "
                        f"(tried: {'; '.join(tried) or str(DEFAULT_BIN) + ', PATH'})")


_UNSET = object()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server(served.ServerProcess):
    """One llama-server process on 127.0.0.1 with a given adapter list (``served.ServerProcess``: its
    session, its log, HTTP to it)."""

    poll_s = 0.2  # llama-server comes up in a second or two
    tail_lines = 30

    def __init__(self, argv: list[str], startup_timeout: float, request_timeout: float):
        port = _free_port()
        super().__init__([*argv, "--host", "127.0.0.1", "--port", str(port)], port, label="llama-server",
                         owner="engine 'llamacpp' (served)", log_prefix="lora-conformance-llama-server-",
                         startup_timeout=startup_timeout, request_timeout=request_timeout,
                         max_bytes=MAX_RESPONSE_BYTES)

    def start_failure(self) -> str:
        """The log's error lines (llama.cpp's own words), else its tail."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ": (no log)"
        bad = [ln.strip() for ln in lines if any(w in ln.lower() for w in ("error", "failed", "invalid", "abort"))]
        return ": " + ("; ".join(bad[-4:]) if bad else "\n".join(lines[-15:]))

    def error(self, parsed: Any, what: str) -> EngineError:
        return _server_error(parsed, what)


def _server_error(parsed: Any, what: str) -> EngineError:
    return EngineFailure(f"llama-server {what}: {served.error_message(parsed)}")


class LlamaServerEngine(Engine):
    """Created through ``LlamaCppEngine`` with ``--engine-arg mode=served`` (the registered name stays
    ``llamacpp``); see the module docstring."""

    name = "llamacpp"
    Args = LlamaServerArgs
    requires = ("gguf",)
    extra = "llamacpp"
    slow_start = True
    standard_args = STANDARD_ARGS
    base_quantizations = {"q8_0": "GGUF Q8_0 blocks written by our converter (llamacpp_convert.QuantizedBase), "
                                  "served by llama-server",
                          "q4_k": "GGUF Q4_K blocks written by our converter (llamacpp_convert.QuantizedBase), "
                                  "served by llama-server"}

    @classmethod
    def declared_activations(cls, cfg, model_dir, device, dtype=None) -> Optional[str]:
        """As the offline mode's: ggml's CPU dot products read Q8_0 / Q8_K activation blocks."""
        from lora_conformance.models.quant import gguf_activations

        return gguf_activations(model_dir)

    @classmethod
    def declared_capabilities(cls, cfg, model_dir, device):
        return capabilities(cfg, model_dir)

    @classmethod
    def not_declared_reasons(cls, cfg, model_dir, device):
        return not_declared(cfg, model_dir)

    @classmethod
    def declared_limits(cls, cfg, model_dir, device):
        return limits(cfg)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        from lora_conformance.engines import llamacpp_convert
        from lora_conformance.engines.llamacpp_convert import gguf_cache, torch_threads

        self.cfg = a = self.parse_args(self.args)
        if devices.device_type(device) != "cpu":
            raise UnsupportedFeatureError(f"engine 'llamacpp' (mode=served): ci/install_llama_server.sh builds a "
                                          f"CPU-only llama-server; device {device!r} needs a build with that backend")
        if dtype not in KV_TYPES:
            raise EngineError(f"engine 'llamacpp': dtype {dtype!r} is not one of {', '.join(KV_TYPES)}")
        self.kind = model_support(self.model_dir)
        if self.kind is None:
            raise UnsupportedFeatureError(f"engine 'llamacpp': {self.model_dir.name}: our GGUF converter writes "
                                          f"model_type {', '.join(llamacpp_convert.ARCHES)} only")
        self.binary = find_server(a)
        self.flash = a.flash_attn or ("off" if dtype == "float32" else "auto")
        self.n_threads = a.n_threads or torch_threads()
        self.cache_dir = Path(a.gguf_cache) if a.gguf_cache else gguf_cache(self.model_dir)
        self._convert = llamacpp_convert
        self.gguf = llamacpp_convert.convert_model(self.model_dir, self.cache_dir / "models", dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.capabilities = capabilities(a, self.model_dir)
        self.limits = limits(a)
        self._adapters: "OrderedDict[str, Path]" = OrderedDict()  # name -> converted GGUF
        self._ids: dict[str, int] = {}  # name -> --lora index of the running server
        self._global: object = _UNSET  # encoder: the adapter whose global scale is 1 (None: the base)
        self._server: Optional[_Server] = None
        self._change = threading.Lock()  # one adapter-set change at a time
        self._cond = threading.Condition()
        self._running = 0  # requests in flight on the running server
        self._closed = False
        self._start(list(self._adapters.items()))

    # ---- the server and its adapter set --------------------------------------------------

    def _argv(self, adapters: Sequence[tuple[str, Path]]) -> list[str]:
        a = self.cfg
        argv = [str(self.binary), "-m", str(self.gguf), "-c", str(a.n_ctx * a.parallel), "--parallel",
                str(a.parallel), "--cont-batching", "--threads", str(self.n_threads), "--threads-batch",
                str(self.n_threads), "--flash-attn", self.flash, "--cache-type-k", KV_TYPES[self.dtype],
                "--cache-type-v", KV_TYPES[self.dtype], "--n-gpu-layers", "0", "--no-warmup", "--no-webui",
                "--threads-http", str(max(4, a.parallel + 2))]
        if not a.prefix_cache:
            argv += ["--no-cache-prompt", "--cache-ram", "0"]
        else:
            argv += ["--cache-ram", str(a.cache_ram)]
        if a.kv_unified is not None:
            argv.append("--kv-unified" if a.kv_unified else "--no-kv-unified")
        if not a.extra_bufts:  # llama-server's name for use_extra_bufts=false (common/arg.cpp: no_extra_bufts)
            argv.append("--no-repack")
        if a.chunked_prefill_size:
            argv += ["--batch-size", str(a.chunked_prefill_size), "--ubatch-size", str(a.chunked_prefill_size)]
        if self.kind == "encoder":
            argv += ["--embedding", "--pooling", self._convert.encoder_pooling(self.model_dir)]
            if not a.chunked_prefill_size:  # an encoder's whole input goes in one ubatch
                argv += ["--batch-size", str(a.n_ctx), "--ubatch-size", str(a.n_ctx)]
        for _, path in adapters:
            argv += ["--lora", str(path)]
        if adapters:
            argv.append("--lora-init-without-apply")
        return argv

    def _start(self, adapters: Sequence[tuple[str, Path]]) -> None:
        self._server = _Server(self._argv(adapters), self.cfg.startup_timeout, self.cfg.request_timeout)
        self._ids = {name: i for i, (name, _) in enumerate(adapters)}
        # Not None: a fresh server's global scales are 1.0 for every adapter (FINDINGS["init_without_apply"]),
        # so the first embed call sets them whatever it asks for.
        self._global = _UNSET

    def _change_set(self, new: "OrderedDict[str, Path]", what: str) -> None:
        """Restart the server with the adapters ``new`` once the running requests have finished; on a
        failed start the previous set is started again and the failure is llama.cpp's refusal."""
        with self._change:
            if self._closed:
                raise EngineFailure("engine 'llamacpp' (served) is closed")
            if list(new.items()) == list(self._adapters.items()) and self._server is not None:
                return
            with self._cond:
                self._cond.wait_for(lambda: self._running == 0)
                old = OrderedDict(self._adapters)
                self._server.stop()
                try:
                    self._start(list(new.items()))
                except EngineFailure as exc:
                    self._start(list(old.items()))
                    raise AdapterIncompatibleError(f"engine 'llamacpp' (served): llama-server refused {what}: {exc}") \
                        from None
                self._adapters = new

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        from lora_conformance.adapters.validate import validate_name

        validate_name(name)  # llama-server knows adapters by index: the plugin keeps the names, so it checks them
        info = read_adapter_info(path)
        if info.max_rank > self.cfg.max_rank:
            raise AdapterIncompatibleError(f"adapter {name!r} ({path}): rank {info.max_rank} > max_rank "
                                           f"{self.cfg.max_rank}")
        gguf_file = self._convert.convert_adapter(Path(path), self.model_dir, self.cache_dir / "adapters",
                                                  self.cfg.max_rank, self.dtype)
        new = OrderedDict(self._adapters)
        new[name] = gguf_file
        self._change_set(new, f"adapter {name!r} ({path}, converted to {gguf_file.name})")

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoadedError(name, list(self._adapters))
        new = OrderedDict(self._adapters)
        del new[name]
        self._change_set(new, f"the adapter set without {name!r}")

    def list_adapters(self) -> list[str]:
        return list(self._adapters)

    def engine_adapters(self) -> Optional[list[str]]:
        """The adapters llama-server holds (``GET /lora-adapters``: id, path, scale), by our names."""
        with self._change:
            listed = self._server.request("GET", "/lora-adapters") or []
            by_path = {str(p): n for n, p in self._adapters.items()}
            names = []
            for entry in listed:
                path = str(entry.get("path", ""))
                if path not in by_path:
                    raise EngineFailure(f"llama-server lists an adapter the plugin did not give it: {entry}")
                names.append(by_path[path])
            return names

    # ---- requests --------------------------------------------------------------------------

    def _admit(self, requests: Sequence[GenerationRequest]) -> None:
        """Count ``requests`` as running on the current server (an adapter change waits for them)."""
        self.require_loaded(requests)
        with self._change:  # not while the set changes
            if self._closed:
                raise EngineFailure("engine 'llamacpp' (served) is closed")
            with self._cond:
                self._running += len(requests)

    def _done(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def _body(self, req: GenerationRequest, ids: list[int], stream: bool) -> dict:
        a = self.cfg
        if len(ids) + req.max_new_tokens > a.n_ctx:
            raise EngineFailure(f"engine 'llamacpp' (served): {len(ids)} prompt + {req.max_new_tokens} new tokens "
                                f"> the slot's context n_ctx={a.n_ctx}")
        # Every loaded adapter's scale, explicitly: a request without "lora" (or with []) gets the global
        # scales, which are 1.0 even under --lora-init-without-apply (FINDINGS["init_without_apply"]).
        lora = [{"id": i, "scale": 1.0 if name == req.adapter else 0.0} for name, i in self._ids.items()]
        return {"prompt": ids, "n_predict": req.max_new_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                "min_p": 0.0, "repeat_penalty": 1.0, "n_probs": max(1, req.top_k), "post_sampling_probs": False,
                "return_tokens": True, "ignore_eos": bool(req.ignore_eos), "cache_prompt": bool(a.prefix_cache),
                "samplers": ["temperature"], "lora": lora, "stream": stream}

    def _one(self, req: GenerationRequest, started: Optional[threading.Event] = None) -> GenerationResult:
        try:
            if req.prompt_logprobs:
                raise UnsupportedFeatureError(
                    f"engine 'llamacpp' (served): prompt logprobs: {NOT_DECLARED[Capability.PROMPT_LOGPROBS]}")
            ids = list(self.tokenizer(req.prompt)["input_ids"])
            body = self._body(req, ids, stream=started is not None)
            if started is None:
                out = self._server.request("POST", "/completion", body)
                return self._result(req, ids, out.get("completion_probabilities") or [], out)
            probs, last = [], None
            for chunk in self._server.stream("/completion", body):
                if "error" in chunk:
                    raise _server_error(chunk, "POST /completion (stream)")
                probs.extend(chunk.get("completion_probabilities") or [])
                if probs:
                    started.set()
                last = chunk
            if last is None:
                raise EngineFailure("llama-server's streamed /completion ended without an answer")
            return self._result(req, ids, probs, last)
        finally:
            if started is not None:
                started.set()
            self._done()

    def _result(self, req: GenerationRequest, ids: list[int], probs: Sequence[Mapping], out: Mapping) -> GenerationResult:
        """Token ids and per-step top-k from ``completion_probabilities`` (one entry per generated
        token: its ``id`` and the pre-sampling ``top_logprobs``)."""
        tokens, tops = [], []
        for step in probs:
            tokens.append(int(step["id"]))
            tops.append(trim_topk({int(t["id"]): float(t["logprob"]) for t in step.get("top_logprobs") or ()
                                   if t.get("logprob") is not None}, req.top_k))
        if len(tokens) > req.max_new_tokens:
            raise EngineFailure(f"llama-server answered {len(tokens)} tokens for n_predict={req.max_new_tokens}")
        cached = (out.get("timings") or {}).get("cache_n")
        return GenerationResult(token_ids=tokens, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                                logprobs=tops, prompt_token_ids=ids, prompt_logprobs=None,
                                cached_tokens=int(cached) if cached is not None else None)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self.kind == "encoder":
            raise UnsupportedFeatureError("engine 'llamacpp' (served): an encoder base serves embeddings (embed)")
        self._admit(requests)
        if len(requests) == 1:
            return [self._one(requests[0])]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            futures = [pool.submit(self._one, r) for r in requests]
        return [f.result() for f in futures]

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestHandle:
        """Each request streams from ``/completion`` on a thread of its own (first token -> started)."""
        if self.kind == "encoder":
            raise UnsupportedFeatureError("engine 'llamacpp' (served): an encoder base serves embeddings (embed)")
        self._admit(requests)
        return FuturesHandle.on_threads(self._one, requests)

    def embed(self, texts: Sequence[str], adapter: Optional[str] = None) -> list[list[float]]:
        """``POST /embedding`` (normalised, the server's pooling) after ``POST /lora-adapters`` set the
        adapter's global scale: llama-server's embedding requests take no per-request adapter."""
        if self.kind != "encoder":
            raise UnsupportedFeatureError("engine 'llamacpp' (served): embeddings need an encoder base")
        if not isinstance(adapter, (str, type(None))):
            raise UnsupportedFeatureError(f"engine 'llamacpp' (served): one adapter per embed call: "
                                          f"{ENCODER_NOT_DECLARED[Capability.MIXED_BATCH]}")
        if adapter is not None and adapter not in self._adapters:
            raise AdapterNotLoadedError(adapter, list(self._adapters))
        with self._change:  # the global scales are the server's state: one embed call at a time
            if self._global != adapter:
                scales = [{"id": i, "scale": 1.0 if n == adapter else 0.0} for n, i in self._ids.items()]
                self._server.request("POST", "/lora-adapters", scales)
                self._global = adapter
            out = []
            for text in texts:
                ids = list(self.tokenizer(text)["input_ids"])
                ans = self._server.request("POST", "/embedding", {"content": ids, "embd_normalize": 2})
                vec = ans[0]["embedding"] if isinstance(ans, list) else ans["embedding"]
                if vec and isinstance(vec[0], list):  # rows: one when pooled, one per token otherwise
                    if len(vec) != 1:
                        raise EngineFailure(f"llama-server answered {len(vec)} embedding rows for one text; expected "
                                            "one pooled vector")
                    vec = vec[0]
                out.append([float(x) for x in vec])
            return out

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._change:
            if self._closed:
                return
            self._closed = True
            if self._server is not None:
                self._server.stop()

    def version(self) -> str:
        return f"llama-server ({LLAMA_CPP}; {self.binary}; {self.gguf.name})"

    def settings(self) -> dict:
        a = self.cfg
        effective = {"mode": "served", "parallel": a.parallel, "cache_ram (MiB)": a.cache_ram if a.prefix_cache else 0, "n_ctx per slot": a.n_ctx, "n_threads": self.n_threads,
                     "flash_attn": self.flash, "cache_type_k / cache_type_v": KV_TYPES[self.dtype],
                     "weights": self.dtype, "lora factors": "float32", "cache_prompt": a.prefix_cache,
                     "batch_size / ubatch_size": a.chunked_prefill_size or "llama-server default (2048 / 512)",
                     "adapter set change": "the server restarts with the new --lora list after running requests end",
                     "gguf": self.gguf.name, "binary": str(self.binary)}
        differs = {"cache_type_k / cache_type_v": {"ours": KV_TYPES[self.dtype], "engine_default": "f16",
                                                   "why": "the KV cache in the precision being certified"},
                   "--lora-init-without-apply": {"ours": "on", "engine_default": "off (every adapter at scale 1)",
                                                 "why": "each request names its adapter"},
                   "--no-warmup": {"ours": "on", "engine_default": "off", "why": "a faster restart; no effect on "
                                                                                  "outputs"}}
        if a.prefix_cache and a.cache_ram != SERVER_CACHE_RAM:
            differs["--cache-ram"] = {"ours": a.cache_ram, "engine_default": SERVER_CACHE_RAM,
                                      "why": "the host prompt cache restores one adapter's KV for another's request "
                                             "(FINDINGS['cache_ram']); the slots' own prompt cache stays on"}
        if not a.extra_bufts:
            differs["--no-repack"] = {"ours": "on (engine arg extra_bufts=0)", "engine_default": "off (repacked and AMX "
                                      "buffers for quantised weights)", "why": "asked for: llama.cpp's AMX buffers "
                                      "segfault in llama_decode on some hosts (ggml-org/llama.cpp#20824)"}
        if self.flash != "auto":
            differs["flash_attn"] = {"ours": self.flash, "engine_default": "auto",
                                     "why": "llama.cpp's CPU flash attention computes in half precision"}
        return {"effective": effective, "differs_from_engine_default": differs,
                "not_declared": {c.value: why for c, why in not_declared(a, self.model_dir).items()}}
