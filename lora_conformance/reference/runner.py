"""The reference: HF transformers + PEFT, one request at a time, greedy, with top-k logprobs.

Each request runs alone (batch of one, no padding), so the reference never depends on
batching. Adapters load into a fresh copy of the base model each, keyed by their content
hash, so two adapters never share PEFT state and a re-synthesised name is never stale.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from lora_conformance import parallel
from lora_conformance.reference.cache import ReferenceCache, key_of
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

RUNNER_VERSION = 3  # 3: keys use models.content_hash / adapters.adapter_hash


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    """Library versions for cache keys, without importing what is not loaded yet: a warm cache hit
    must not pay for importing PEFT (about 2 s of cpu per process). The installed distribution's
    version, whether or not the module is loaded: a module's own ``__version__`` can differ from it
    (PyPI's CUDA torch wheels: ``2.11.0+cu130`` against ``2.11.0``), and a key that depended on what
    the process had imported first would miss the entries another process wrote. Only a module with
    no distribution metadata (a source tree on the path) is imported for its ``__version__``."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
    return out


def kv_cache_argument(model: Any) -> str:
    """The name under which ``model`` takes (and returns) its KV cache: ``cache`` in the transformers
    releases that have it (``past_key_values`` is deprecated there, for removal in 5.40), else
    ``past_key_values``. Read from the base model's ``forward`` signature (PEFT's takes ``**kwargs``)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        parameters = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _topk(logprobs_row, k: int, extra: Optional[int] = None) -> TopK:
    vals, ids = logprobs_row.topk(k)
    out = {int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())}
    if extra is not None and extra not in out:
        out[int(extra)] = float(logprobs_row[extra])
    return out


# Prompt positions whose log-softmax a reference holds at once: an 8,192-token prompt over a 151,936-id
# vocabulary is 5 GB of float32 logits, and a second 5 GB for their log-softmax taken at once.
PROMPT_ROWS_AT_ONCE = 256


def _prompt_topk(logits, ids, k: int, rows_at_once: int = PROMPT_ROWS_AT_ONCE) -> list[TopK]:
    """Each prompt position's top ``k`` next-token logprobs and the logprob of the token that follows
    it (``ids[p + 1]``), from the prompt's ``logits`` (positions x vocabulary), a block of positions at
    a time: the log-softmax is taken row by row, so the values are those of the whole at once."""
    import torch

    n = logits.shape[0] - 1  # the last position has no next prompt token
    out: list[TopK] = []
    for a in range(0, n, rows_at_once):
        b = min(n, a + rows_at_once)
        lps = torch.log_softmax(logits[a:b].float(), dim=-1)
        nxt = ids[a + 1:b + 1]
        vals, top = lps.topk(k, dim=-1)
        nxt_lp = lps.gather(1, nxt.view(-1, 1)).view(-1)
        for row_ids, row_vals, t, t_lp in zip(top.tolist(), vals.tolist(), nxt.tolist(), nxt_lp.tolist()):
            row = dict(zip(map(int, row_ids), map(float, row_vals)))
            row.setdefault(int(t), float(t_lp))
            out.append(row)
    return out


def sum_work(works: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Several ``ReferenceRunner.work()`` summed key by key (numbers only): a process's runners, or a
    run's processes."""
    total: dict[str, float] = {}
    for work in works:
        for key, value in work.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = round(total.get(key, 0) + value, 3)
    return total


# Bytes of adapted model copies a reference keeps (the base's own copy aside).
MODEL_COPY_BUDGET = 12 << 30
# On cpu a copy is made in host memory, beside the engine under test: an older copy is dropped first
# unless MemAvailable leaves this much more than the copy's bytes.
HOST_ROOM = 1.25


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# Bytes of reference models (bases and adapted copies) one process keeps over all its bases. A
# full-profile worker judged the decoder and the MoE base (7 GB each in float32, each with an adapted
# copy) and kept both to its end: 27 GB of its 49 GB on an H200, where one base's set is 14 GB.
LOADED_MODELS_BUDGET = 16 << 30


class LoadedModels:
    """The reference runners of one process (one per base model) that hold loaded models, least
    recently used first. Before a runner loads a model (its base or an adapted copy), the other
    runners' models are dropped, oldest first, until what the process then holds fits in the budget;
    a runner's own models are bounded by MODEL_COPY_BUDGET, not here. Small bases never reach it."""

    def __init__(self, budget: int = LOADED_MODELS_BUDGET):
        self.budget = budget
        self._runners: "OrderedDict[ReferenceRunner, None]" = OrderedDict()
        self.released = 0  # other runners' model sets dropped to make room

    def use(self, runner: "ReferenceRunner") -> None:
        self._runners[runner] = None
        self._runners.move_to_end(runner)

    def admit(self, runner: "ReferenceRunner", nbytes: int) -> None:
        """Room for ``nbytes`` more of ``runner``'s models (it becomes the most recently used)."""
        self.use(runner)
        held = {r: r.held_bytes() for r in self._runners}
        total = sum(held.values())
        for other, freed in held.items():  # oldest first
            if total + nbytes <= self.budget:
                break
            if other is not runner and freed:
                other.release_models()
                self.released += 1
                total -= freed


class ReferenceRunner:
    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32",
                 cache: Optional[ReferenceCache] = None, max_models: int = 4,
                 tokenizer_cache: Optional[Path] = None, loaded: Optional[LoadedModels] = None):
        self.model_dir = Path(model_dir)
        # What the process's other runners hold counts against one budget (Workspace shares one); a
        # runner made alone bounds only its own copies.
        self._loaded = loaded if loaded is not None else LoadedModels()
        self.device = device
        self.dtype = dtype
        self.cache = cache
        self.forward_passes = 0  # model forward calls actually made (a warm cache makes none)
        # Where a cold reference spends its time (work()): loading the base, making adapted copies,
        # computing outputs; a warm cache spends none of it.
        self.base_loads = 0
        self.base_load_s = 0.0
        self.copies = 0
        self._rotary = None  # the RotaryGuard on the base (rotary_guard.py), made with it
        self.copy_s = 0.0
        self.computed = 0
        self.compute_s = 0.0
        self._max_models = max_models
        self._tokenizer_cache = tokenizer_cache  # where the tokenizer class choice is kept (load_tokenizer)
        self._base = None
        self._models: "OrderedDict[str, Any]" = OrderedDict()
        self._tokenizer = None
        self._model_hash: Optional[str] = None
        self._adapter_hashes: dict[Path, str] = {}
        self._encoder: Optional[bool] = None
        self._base_quant: Optional[dict] = None

    @property
    def base_quant(self) -> dict:
        """Cache-key part of a quantised base (models/quant.py): its scheme and quantiser version,
        beside the model hash of the dequantised weights; empty for a float base (keys unchanged)."""
        if self._base_quant is None:
            from lora_conformance.models.quant import read_manifest

            m = read_manifest(self.model_dir)
            self._base_quant = {} if m is None else {"base_quant": [m["scheme"], m["quant_version"]]}
        return self._base_quant

    # ---- lazily loaded state --------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from lora_conformance.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir, self._tokenizer_cache)
        return self._tokenizer

    def token_count(self, text: str) -> int:
        """How many prompt tokens the reference gives ``text`` (special tokens included, as in
        ``prompt_token_ids``)."""
        return len(self.tokenizer(text)["input_ids"])

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(int(token_id))

    @property
    def model_hash(self) -> str:
        if self._model_hash is None:
            from lora_conformance.models import content_hash

            self._model_hash = content_hash(self.model_dir)
        return self._model_hash

    def adapter_hash(self, path: Path) -> str:
        path = Path(path)
        if path not in self._adapter_hashes:
            from lora_conformance.adapters import adapter_hash

            self._adapter_hashes[path] = adapter_hash(path)
        return self._adapter_hashes[path]

    @property
    def is_encoder(self) -> bool:
        if self._encoder is None:
            from lora_conformance.checkpoints import model_kind

            self._encoder = model_kind(self.model_dir) == "encoder"
        return self._encoder

    def _torch_dtype(self):
        from lora_conformance.checkpoints import torch_dtype

        return torch_dtype(self.dtype)

    def _load_base(self):
        """The base model, on the reference's device from the start: an adapted copy is then a copy
        on that device (a 7 GB base deep-copied on the host and moved over took seconds per copy)."""
        if self._base is None:
            from transformers import AutoModel, AutoModelForCausalLM

            self._loaded.admit(self, self.base_bytes)
            start = time.perf_counter()
            cls = AutoModel if self.is_encoder else AutoModelForCausalLM
            self._base = cls.from_pretrained(self.model_dir, dtype=self._torch_dtype()).eval().to(self.device)
            from lora_conformance.reference.rotary_guard import RotaryGuard

            self._rotary = self._rotary or RotaryGuard()  # one count over reloads (release_models)
            self._rotary.install(self._base)  # adapted copies are deep copies: they keep the hooks
            self.base_loads += 1
            self.base_load_s += time.perf_counter() - start
        return self._base

    @functools.cached_property
    def base_bytes(self) -> int:
        """The base's parameter bytes in the reference's dtype, from its checkpoint's headers (known
        before it is loaded; read once, the base reloads after a release)."""
        from lora_conformance.adapters.weights import read_header
        from lora_conformance.checkpoints import torch_dtype

        itemsize = torch_dtype(self.dtype).itemsize
        return sum(math.prod(shape) * itemsize for f in sorted(self.model_dir.glob("*.safetensors"))
                   for _dtype, shape in read_header(f).values())

    def held_bytes(self) -> int:
        """Parameter bytes of the models this runner keeps loaded (its base and adapted copies)."""
        models = {id(m): m for m in self._models.values()}
        if self._base is not None:
            models[id(self._base)] = self._base
        return sum(_param_bytes(m) for m in models.values())

    def release_models(self) -> None:
        """Drop the loaded base and its adapted copies (loaded again when next needed): what a real-shape
        base holds (7 GB each in float32) is given back before the run starts engines it no longer
        judges against the models (the end-of-run audit compares with the run's own outputs)."""
        self._models.clear()
        self._base = None
        parallel.release_freed_memory()

    @staticmethod
    def by_model(indices, path_of) -> list[int]:
        """``indices`` in the order that groups them by the model they run on (``path_of(i)``: an
        adapter directory, or None for the base), the base first, the given order kept within a
        model: computed in that order, the outputs need one adapted copy per adapter instead of one
        per change of adapter (callers that ask for many outputs at once, the judge's paired
        scores, order them so)."""
        return sorted(indices, key=lambda i: (path_of(i) is not None, str(path_of(i) or "")))

    def work(self) -> dict[str, float]:
        """What this runner computed and what it took (seconds), with its cache's hits and misses."""
        return {"base_loads": self.base_loads, "base_load_s": round(self.base_load_s, 3),
                "copies": self.copies, "copy_s": round(self.copy_s, 3), "computed": self.computed,
                "rotary_recomputed": self._rotary.recomputed if self._rotary is not None else 0,
                "compute_s": round(self.compute_s, 3), "forward_passes": self.forward_passes,
                "cache_hits": self.cache.hits if self.cache is not None else 0,
                "cache_misses": self.cache.misses if self.cache is not None else 0}

    def _model_for(self, adapter_path: Optional[Path]):
        key = "__base__" if adapter_path is None else self.adapter_hash(adapter_path)
        if key in self._models:
            self._models.move_to_end(key)
            self._loaded.use(self)
            return self._models[key]
        base = self._load_base()
        if adapter_path is not None:
            # Adapted copies are kept within MODEL_COPY_BUDGET (at least one), the oldest dropped before
            # the next is made: a real-shape base (profile full, 7 GB in float32) with max_models copies
            # per worker ran an H200 out of memory at two workers, and a 24 GiB cpu machine at one (the
            # engine's own 7 GB beside them). On cpu also while the host lacks room for the copy.
            nbytes = _param_bytes(base)
            keep = max(1, min(self._max_models - 1, MODEL_COPY_BUDGET // nbytes))

            def room_short() -> bool:
                room = parallel.available_memory() if self.device == "cpu" else None
                return room is not None and room < HOST_ROOM * nbytes

            while (copies := [k for k in self._models if k != "__base__"]) and (len(copies) >= keep or room_short()):
                del self._models[copies[0]]  # the oldest copy
                if self.device == "cpu":
                    parallel.release_freed_memory()  # MemAvailable is read again next: let the copy's memory go first
        if adapter_path is None:
            model = base
        else:
            from peft import PeftModel

            self._loaded.admit(self, nbytes)
            start = time.perf_counter()
            model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_path)).eval().to(self.device)
            self.copies += 1
            self.copy_s += time.perf_counter() - start
        self._models[key] = model
        while len(self._models) > self._max_models:
            self._models.popitem(last=False)
        return model

    # ---- generation -----------------------------------------------------------------

    def _cache_key(self, req: GenerationRequest, adapter_path: Optional[Path], kind: str) -> str:
        return key_of({
            "kind": kind,
            "runner": RUNNER_VERSION,
            "model": self.model_hash,
            "adapter": None if adapter_path is None else self.adapter_hash(adapter_path),
            "request": {"prompt": req.prompt, "max_new_tokens": req.max_new_tokens, "top_k": req.top_k,
                        "prompt_logprobs": req.prompt_logprobs, "ignore_eos": req.ignore_eos},
            "dtype": self.dtype,
            "device_type": self.device.split(":")[0],
            "versions": _versions(),
            **self.base_quant,
        })

    def generate(self, requests: Sequence[GenerationRequest],
                 adapters: Mapping[str, Path] = {}) -> list[GenerationResult]:
        """Reference outputs; ``adapters`` maps each request's adapter name to its PEFT directory.

        Computed adapter by adapter (results in the requests' order): a mixed batch's references
        then make one adapted copy per adapter, not one per change of adapter along the batch."""
        paths: list[Optional[Path]] = []
        for req in requests:
            if req.adapter is not None and req.adapter not in adapters:
                raise KeyError(f"reference: no adapter directory given for {req.adapter!r}")
            paths.append(None if req.adapter is None else Path(adapters[req.adapter]))
        results: list[Optional[GenerationResult]] = [None] * len(requests)
        for i in self.by_model(range(len(requests)), paths.__getitem__):
            results[i] = self._generate_one(requests[i], paths[i])
        return results  # type: ignore[return-value]

    def _generate_one(self, req: GenerationRequest, adapter_path: Optional[Path]) -> GenerationResult:
        if self.cache is None:
            return self._compute(req, adapter_path)
        key = self._cache_key(req, adapter_path, "generate")
        hit = self.cache.get(key, GenerationResult.from_dict)
        if hit is not None:
            return hit
        with self.cache.lock(key):
            hit = self.cache.get(key, GenerationResult.from_dict)  # another worker may have filled it meanwhile
            if hit is not None:
                return hit
            self.cache.misses += 1
            result = self._compute(req, adapter_path)
            self.cache.put(key, result.to_dict())
            return result

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """Count one computed output and its seconds, less the base loads and copies made meanwhile."""
        start, made = time.perf_counter(), self.copy_s + self.base_load_s
        try:
            yield
        finally:
            self.computed += 1
            self.compute_s += time.perf_counter() - start - (self.copy_s + self.base_load_s - made)

    def _compute(self, req: GenerationRequest, adapter_path: Optional[Path]) -> GenerationResult:
        with self._computing():
            return self._decode(self._model_for(adapter_path), req)

    def _decode(self, model, req: GenerationRequest) -> GenerationResult:
        import torch

        tok = self.tokenizer
        ids = tok(req.prompt, return_tensors="pt").input_ids.to(self.device)
        eos = tok.eos_token_id
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            self.forward_passes += 1
            prompt_lps = _prompt_topk(out.logits[0], ids[0], req.top_k) if req.prompt_logprobs else None
            cache_arg = kv_cache_argument(model)
            past = getattr(out, cache_arg)
            step_lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # row by row: as of the whole
            del out  # the prompt's logits (5 GB at 8,192 tokens and 151,936 ids), before the decode steps
            generated: list[int] = []
            step_topk: list[TopK] = []
            for step in range(req.max_new_tokens):
                nxt = int(step_lp.argmax())
                generated.append(nxt)
                step_topk.append(_topk(step_lp, req.top_k))
                if (not req.ignore_eos and nxt == eos) or step == req.max_new_tokens - 1:
                    break
                out = model(input_ids=torch.tensor([[nxt]], device=self.device), use_cache=True, **{cache_arg: past})
                self.forward_passes += 1
                past = getattr(out, cache_arg)
                step_lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        return GenerationResult(
            token_ids=generated,
            text=tok.decode(generated, skip_special_tokens=True),
            logprobs=step_topk,
            prompt_token_ids=ids[0].tolist(),
            prompt_logprobs=prompt_lps,
        )

    # ---- teacher-forced contexts ----------------------------------------------------

    def context_logprobs(self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]],
                         adapter_path: Optional[Path] = None, hypothesis=None, *,
                         ids: Optional[Sequence[Sequence[Sequence[int]]]] = None, top: int = 32) -> list[list[TopK]]:
        """Next-token logprobs after each context ``sequence[:p + 1]`` for p in ``positions`` (teacher
        forcing: one forward pass per sequence gives every context at once).

        Without ``ids``: the ``top`` most likely ids per context. With ``ids`` (one id list per
        sequence and position): the logprobs of exactly those ids. ``hypothesis``
        (``lora_conformance.judge.hypotheses.Hypothesis``) transforms the adapter first; None is correct.
        Cached like generations."""
        from lora_conformance.judge import hypotheses as hyps

        hyp = hypothesis or hyps.correct()
        key = None
        if self.cache is not None:
            key = key_of({"kind": "contexts", "runner": RUNNER_VERSION, "model": self.model_hash,
                          "adapter": None if adapter_path is None else self.adapter_hash(adapter_path),
                          "hypothesis": hyp.key(), "sequences": [list(map(int, s)) for s in sequences],
                          "positions": [list(map(int, p)) for p in positions], "ids": ids, "top": top,
                          "dtype": self.dtype, "device_type": self.device.split(":")[0], "versions": _versions(),
                          **self.base_quant})
            hit = self.cache.get(key)
            if hit is not None and isinstance(hit, dict) and isinstance(hit.get("rows"), list):
                return [[{int(k): float(v) for k, v in row.items()} for row in seq] for seq in hit["rows"]]
        with self._computing():
            rows = self._context_rows(sequences, positions, adapter_path, hyp, ids, top)
        if key is not None:
            with self.cache.lock(key):
                self.cache.misses += 1
                self.cache.put(key, {"rows": [[{str(k): v for k, v in row.items()} for row in seq] for seq in rows]})
        return rows

    def step_logprobs(self, result: GenerationResult, step: int, ids: Sequence[int],
                      adapter_path: Optional[Path] = None) -> Optional[TopK]:
        """The logprobs of ``ids`` at decode step ``step`` of ``result`` (a greedy decode this runner made
        with ``adapter_path``), teacher-forced on its prompt and its first ``step`` tokens: what its
        top-k leaves out. None without the result's prompt ids."""
        if not result.prompt_token_ids:
            return None
        seq = list(result.prompt_token_ids) + list(result.token_ids[:step])
        return self.context_logprobs([seq], [[len(seq) - 1]], adapter_path, ids=[[[int(t) for t in ids]]])[0][0]

    def _context_rows(self, sequences, positions, adapter_path, hyp, ids, top) -> list[list[TopK]]:
        import torch

        from lora_conformance.judge import hypotheses as hyps

        model = self._model_for(adapter_path if hyp.kind != hyps.BASE else None)
        n = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id or 0
        batch = torch.full((len(sequences), n), pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), n), dtype=torch.long)
        for i, s in enumerate(sequences):  # right padding: a context's last position never sees a pad
            batch[i, :len(s)] = torch.tensor(list(s))
            mask[i, :len(s)] = 1
        with torch.inference_mode(), hyps.applied(model, hyp, adapter_path):
            logits = model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).logits
            self.forward_passes += 1
        out: list[list[TopK]] = []
        for i, pos in enumerate(positions):
            lps = torch.log_softmax(logits[i, list(pos)].float(), dim=-1).cpu()
            if ids is None:
                out.append([_topk(row, min(top, row.shape[0])) for row in lps])
            else:
                out.append([{int(t): float(row[int(t)]) for t in want} for row, want in zip(lps, ids[i])])
        return out

    # ---- embeddings -----------------------------------------------------------------

    def embed(self, texts: Sequence[str], adapter_path: Optional[Path] = None) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings (one text at a time, cached like generations)."""
        out = []
        for text in texts:
            req = GenerationRequest(prompt=text, max_new_tokens=0)
            key = self._cache_key(req, adapter_path, "embed") if self.cache is not None else None
            hit = self.cache.get(key, _embedding_entry) if key else None
            if hit is None:
                with self._computing():
                    vec = self._embed_one(text, adapter_path)
                if key:
                    with self.cache.lock(key):
                        self.cache.misses += 1
                        self.cache.put(key, {"embedding": vec})
            else:
                vec = hit
            out.append(vec)
        return out

    def _embed_one(self, text: str, adapter_path: Optional[Path]) -> list[float]:
        import torch

        model = self._model_for(adapter_path)
        enc = self.tokenizer(text, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state[0].float()
            self.forward_passes += 1
        mask = enc["attention_mask"][0].float().unsqueeze(-1)
        pooled = (hidden * mask).sum(0) / mask.sum()
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()


def _embedding_entry(value) -> list[float]:
    """A cached embedding entry's vector; raises on any other shape (the cache discards it)."""
    vec = [float(x) for x in value["embedding"]]
    if not vec:
        raise ValueError("empty embedding")
    return vec
