"""A stand-in ``sglang`` module: SGLang's offline Engine API with SGLang's LoRA bookkeeping.

It computes no model: outputs are made-up token ids whose values depend on the request's
adapter (name and the path loaded under it), so the mapping and routing of the plugin can be
checked. What it does follow, from SGLang's source (release 0.5.23 unless ``__version__`` says
an older row; see lora_conformance/engines/sglang_releases.py for the files):

- server args: unknown keyword arguments are a TypeError (``ServerArgs`` is a dataclass);
  ``max_loaded_loras >= max_loras_per_batch``; overlap loading needs ``max_loaded_loras <=
  2 * max_loras_per_batch`` (lora_hook.check_lora_server_args, with its texts);
- ``max_loras_per_batch`` counts the base: pinning is refused once ``max_loras_per_batch - 1``
  adapters are pinned (lora_manager.validate_new_adapter), as are DoRA, a rank above
  ``max_lora_rank``, a target outside ``lora_target_modules``, and a loaded name;
- the tokenizer-side registry (lora_registry.LoRARegistry): 0.5.8+ unregisters the least
  recently used unpinned adapter past ``max_loaded_loras`` and loads it again when a request
  names it; 0.5.1-0.5.3 refuse the load instead; a request naming more distinct lora paths
  than ``max_loaded_loras`` (the base ``None`` counted) is refused; names are looked up in a
  cache that unload never clears, so a request naming an unloaded adapter loads it again;
- load / unload answer with an object (``success``, ``error_message``); ``generate`` raises
  ValueError, as ``Engine.generate`` passes on the tokenizer manager's.
"""

from __future__ import annotations

import json
import types
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from lora_conformance.engines.sglang_releases import release_for

# ServerArgs fields the plugin may pass (a subset of SGLang's); older releases lack some.
SERVER_ARGS = {"model_path", "enable_lora", "max_loras_per_batch", "max_loaded_loras", "max_lora_rank",
               "lora_target_modules", "lora_backend", "device", "dtype", "disable_cuda_graph", "random_seed",
               "disable_radix_cache", "chunked_prefill_size", "tp_size", "attention_backend", "mem_fraction_static",
               "context_length", "is_embedding", "base_gpu_id", "lora_eviction_policy", "enable_lora_overlap_loading",
               "max_total_tokens", "custom_sigquit_handler", "sleep_on_idle"}
SINCE_0_5_8 = {"lora_eviction_policy", "enable_lora_overlap_loading"}


class UpdateOutput:
    def __init__(self, success: bool, error_message: str = ""):
        self.success, self.error_message = success, error_message


class StandInEngine:
    instances: list = []
    version = "0.5.23"
    compute = False  # True: outputs computed by the built-in engine (see module(compute=True))

    def __init__(self, **kwargs):
        self.release = release_for(self.version)
        known = SERVER_ARGS - (SINCE_0_5_8 if not self.release.eviction_policies else set())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument '{unknown[0]}'")
        self.kwargs = kwargs
        self.max_loras_per_batch = kwargs.get("max_loras_per_batch", 8)
        self.max_loaded = kwargs.get("max_loaded_loras")
        assert self.max_loras_per_batch > 0, "max_loras_per_batch must be positive"
        if kwargs.get("enable_lora_overlap_loading"):
            limit = self.max_loras_per_batch * 2
            assert self.max_loaded is not None and self.max_loaded <= limit, (
                "Enabling LoRA overlap loading requires pinning LoRA adapter weights in CPU memory, "
                f"so --max-loaded-loras must be less than or equal to double --max-loras-per-batch: {limit}")
        if self.max_loaded is not None:
            assert self.max_loaded >= self.max_loras_per_batch, (
                "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                f"max_loaded_loras={self.max_loaded}, max_loras_per_batch={self.max_loras_per_batch}")
        self.registry: "OrderedDict[str, tuple[str, bool]]" = OrderedDict()  # name -> (path, pinned), LRU first
        self.ref_cache: dict[str, tuple[str, bool]] = {}  # never cleared by unload (tokenizer_manager.lora_ref_cache)
        self.events: list[tuple] = []
        self.calls: list[tuple] = []
        self.closed = False
        self.model = None
        if self.compute:
            from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine

            # SGLang's own bookkeeping stays here; the built-in engine only computes, with room
            # for every adapter this registry holds and SGLang's adapter slots per batch.
            self.model = BuiltinEngine(Path(kwargs["model_path"]), kwargs.get("device", "cpu"), kwargs.get("dtype"), {
                "max_loras_per_batch": str(max(1, self.max_loras_per_batch - 1)), "max_loaded_loras": "64",
                "max_rank": str(kwargs.get("max_lora_rank", 64)), "prefix_cache": "0" if kwargs.get("disable_radix_cache") else "1"})
        StandInEngine.instances.append(self)

    def _model_load(self, name: str, path: str) -> None:
        if self.model is not None:
            self.model.load_adapter(name, Path(path))

    def _model_unload(self, name: str) -> None:
        if self.model is not None and name in self.model.list_adapters():
            self.model.unload_adapter(name)

    # ---- the backend (lora_manager) ------------------------------------------------------

    @property
    def num_pinned(self) -> int:
        return sum(p for _, p in self.registry.values())

    def _validate_new_adapter(self, name: str, path: str, pinned: bool) -> None:
        cfg_file = Path(path) / "adapter_config.json"
        if not cfg_file.is_file():
            raise ValueError(f"Can't find 'adapter_config.json' at '{path}'")
        cfg = json.loads(cfg_file.read_text())
        if cfg.get("use_dora"):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if name in self.registry:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        targets = set(cfg.get("target_modules") or ())
        allowed = set(self.kwargs.get("lora_target_modules") or ())
        rank = max([int(cfg.get("r", 8)), *[int(r) for r in (cfg.get("rank_pattern") or {}).values()]])
        if rank > self.kwargs.get("max_lora_rank", 0) or ("all" not in allowed and not targets <= allowed):
            raise ValueError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        if pinned and self.num_pinned >= self.max_loras_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters.")

    # ---- the tokenizer manager ---------------------------------------------------------------

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False):
        self.calls.append(("load", lora_name, lora_path, pinned))
        try:
            self._load(lora_name, lora_path, pinned)
        except ValueError as exc:
            return UpdateOutput(False, str(exc))
        return UpdateOutput(True)

    def _load(self, name: str, path: str, pinned: bool) -> None:
        evicts = self.release.beyond_max_loaded == "evict"
        if not evicts and self.max_loaded is not None and len(self.registry) >= self.max_loaded:
            raise ValueError(f"Cannot load LoRA adapter {name} at path {path}. "
                             f"Maximum number of loaded LoRA adapters is {self.max_loaded}. "
                             "Please unload some LoRA adapters before loading new ones.")
        self._validate_new_adapter(name, path, pinned)
        self._model_load(name, path)
        self.registry[name] = (path, pinned)
        self.ref_cache[name] = (path, pinned)
        while evicts and self.max_loaded is not None and len(self.registry) > self.max_loaded:
            victim = next((n for n, (_, p) in self.registry.items() if not p), None)
            if victim is None:
                raise ValueError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                                 f"LoRA registry is: {dict(self.registry)}")
            del self.registry[victim]
            self._model_unload(victim)
            self.events.append(("evicted", victim))

    def unload_lora_adapter(self, lora_name: str):
        self.calls.append(("unload", lora_name))
        if lora_name not in self.registry:
            return UpdateOutput(False, f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self.registry.keys()}")
        del self.registry[lora_name]
        self._model_unload(lora_name)
        return UpdateOutput(True)

    def _resolve(self, lora_paths: list[Optional[str]]) -> None:
        unique = set(lora_paths)
        if self.release.beyond_max_loaded == "evict":
            if self.max_loaded is not None and len(unique) > self.max_loaded:
                raise ValueError(f"Received request with {len(unique)} unique loras requested "
                                 f"but max loaded loras is {self.max_loaded}")
            for name in [n for n in unique if n is not None and n not in self.registry]:
                if name not in self.ref_cache:
                    raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                     f"All loaded adapters: {self.ref_cache.keys()}.")
                self.events.append(("reloaded", name))
                self._load(name, *self.ref_cache[name])
        for name in lora_paths:
            if name is None:
                continue
            if name not in self.registry:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                 f"Loaded adapters: {self.registry.keys()}.")
            self.registry.move_to_end(name)

    def generate(self, prompt=None, sampling_params=None, lora_path=None, return_logprob=False,
                 top_logprobs_num=None, logprob_start_len=None, **kw):
        self.calls.append(("generate", prompt, sampling_params, lora_path, return_logprob, top_logprobs_num,
                           logprob_start_len))
        self._resolve(list(lora_path))
        if self.model is not None:
            return self._computed(prompt, sampling_params, lora_path, top_logprobs_num, logprob_start_len)
        outs = []
        for i, p in enumerate(prompt):
            n, k = sampling_params[i]["max_new_tokens"], top_logprobs_num[i]
            name = lora_path[i]
            # The adapter's identity (its name and the path loaded under it) shows in the ids.
            seed = 10 + 3 * i + (0 if name is None else len(name) + 100 * len(Path(self.registry[name][0]).name))
            ids = [seed + s for s in range(n)]
            top = lambda t: [(-0.25 * (j + 1), t + j, None) for j in range(k)]  # noqa: E731
            meta = {"output_token_logprobs": [(-0.25, t, None) for t in ids],
                    "output_top_logprobs": [top(t) for t in ids]}
            if logprob_start_len[i] == 0:
                prompt_ids = [1] + [4 + j for j in range(len(p.split()))]
                meta["input_token_logprobs"] = [(None, prompt_ids[0], None)] + [(-1.0, t, None) for t in prompt_ids[1:]]
                meta["input_top_logprobs"] = [None] + [top(t) for t in prompt_ids[1:]]
            outs.append({"text": f"out{i}", "output_ids": ids, "meta_info": meta})
        return outs

    def _computed(self, prompt, sampling_params, lora_path, top_logprobs_num, logprob_start_len):
        """The built-in engine's results in SGLang's output format (what the plugin parses)."""
        from lora_conformance.types import GenerationRequest

        reqs = [GenerationRequest(p, a, sp["max_new_tokens"], k, prompt_logprobs=start == 0,
                                  ignore_eos=sp.get("ignore_eos", False))
                for p, sp, a, k, start in zip(prompt, sampling_params, lora_path, top_logprobs_num, logprob_start_len)]
        entries = lambda top: [(lp, t, None) for t, lp in sorted(top.items(), key=lambda x: -x[1])]  # noqa: E731
        outs = []
        for req, res in zip(reqs, self.model.generate(reqs)):
            meta = {"output_token_logprobs": [(step.get(t), t, None) for t, step in zip(res.token_ids, res.logprobs)],
                    "output_top_logprobs": [entries(step) for step in res.logprobs]}
            if req.prompt_logprobs:
                ids = res.prompt_token_ids
                meta["input_token_logprobs"] = [(None, ids[0], None)] + [
                    (step.get(t), t, None) for t, step in zip(ids[1:], res.prompt_logprobs)]
                meta["input_top_logprobs"] = [None] + [entries(step) for step in res.prompt_logprobs]
            outs.append({"text": res.text, "output_ids": list(res.token_ids), "meta_info": meta})
        return outs

    def encode(self, prompt=None, lora_path=None):
        self.calls.append(("encode", prompt, lora_path))
        self._resolve(list(lora_path))
        if self.model is not None:
            return [{"embedding": v, "meta_info": {}} for v in self.model.embed(list(prompt), list(lora_path))]
        return [{"embedding": [3.0, 4.0] if a is None else [0.0, 2.0], "meta_info": {}} for a in lora_path]

    def shutdown(self):
        self.closed = True
        if self.model is not None:
            self.model.close()


def module(version: str = "0.5.23", compute: bool = False) -> types.ModuleType:
    """A fresh ``sglang`` module whose Engine behaves as release ``version``; with ``compute``
    its outputs are the built-in engine's (so the suites can run against SGLang's rules)."""
    mod = types.ModuleType("sglang")
    mod.Engine = type("Engine", (StandInEngine,), {"version": version, "compute": compute})
    mod.__version__ = version
    StandInEngine.instances = []
    return mod
