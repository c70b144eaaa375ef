"""The ``peft`` engine: HF transformers + PEFT, serving mixed-adapter batches.

Every batch goes through one ``generate`` call with ``adapter_names=[...]`` (``"__base__"``
for requests without an adapter), which is PEFT's own mixed-batch path: each LoRA layer
computes the base on the whole batch, then adds each adapter's delta on its rows.

Where PEFT refuses ``adapter_names`` (DoRA adapters; adapters with ``target_parameters``,
i.e. MoE experts), a batch that uses one adapter only is served by activating that adapter
(``set_adapter``), and a batch that mixes is refused with UnsupportedFeatureError.
A loaded ``target_parameters`` adapter blocks ``adapter_names`` for every batch, because
PEFT's parameter wrappers reject the argument even for rows that do not use them.

Two PEFT gaps are closed here, both exactly: (1) a mixed batch where one adapter has a
``modules_to_save`` copy of a module and another has none raised KeyError; the base module
is registered for the others (see ``_fill_modules_to_save_gaps``); (2) PEFT keeps its
parameter wrappers after the last ``target_parameters`` adapter is deleted, so the model is
rebuilt from the remaining adapters' directories then (they must still be on disk).

Padding: prompts are left-padded; generate() derives position ids from the attention mask,
and the prompt-logprob forward is given the same position ids, so a padded row sees the
positions it would see alone. The remaining difference to an unpadded run is the shape of
the matmuls (float32: ~1e-6 on logprobs; see tests/test_engine_peft.py).

What the plugin does in PEFT's place, and the PEFT behaviour each stands for (kept because this
engine is also the suites' second correct implementation: the suites are proven right when it,
the reference and the built-in engine agree, which a NaN adapter or a KeyError would prevent):

- The shared validator refuses bad names and malformed adapters first: PEFT itself loads
  non-finite or integer weights and names any string.
- An adapter whose file lacks weights its config names is refused: PEFT warns ("missing adapter
  keys") and keeps the freshly initialised weights.
- The two gaps above (modules_to_save KeyError, parameter wrappers kept) are closed exactly.

Greedy decoding never stops early here (``eos_token_id=None``); ``ignore_eos=False`` is
applied afterwards by cutting a row after its first EOS, which is exact for greedy
decoding because later steps never influence earlier ones. Each step's chosen token is
checked against the argmax of the raw logits, so a checkpoint's generation_config that
adds logits processors (repetition penalty, ...) fails loudly instead of skewing results.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lora_conformance.engines._hf_common import (
    AdapterInfo,
    is_encoder_only,
    load_tokenizer,
    read_adapter_info,
    topk_from_logprobs,
    torch_dtype,
)
from lora_conformance.engines.base import (
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    Capability,
    Engine,
    EngineFailure,
    Limits,
    UnsupportedFeatureError,
    replace_or_restore,
)
from lora_conformance.engines.args import arg
from lora_conformance.types import GenerationRequest, GenerationResult, TopK

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names
MAX_RANK = 256


@dataclass(frozen=True)
class PeftArgs:
    """No standard args: PEFT has no slots, cache or eviction to configure."""

    attn_implementation: Optional[str] = arg(None, "transformers' attn_implementation (default: its own choice)")
    activations: str = arg("float", "int8: on a GGUF base (q8_0, q4_k), each quantised linear reads its input through "
                                    "the 8-bit activation blocks llama.cpp's CPU kernels use (the LoRA reads it as it "
                                    "is): a negative control of the tolerance row for 8-bit activations",
                           choices=("float", "int8"))


class PeftEngine(Engine):
    # GGUF bases only as the 8-bit-activation control (activations=int8): with float activations PEFT on
    # the snapped weights would be the reference itself, a float base under a quantised name.
    base_quantizations = {"q8_0": "with activations=int8 only: the snapped weights (what the blocks decode to), "
                                  "8-bit activation blocks in front of each quantised linear",
                          "q4_k": "with activations=int8 only: the snapped weights (what the blocks decode to), "
                                  "8-bit activation blocks in front of each quantised linear"}
    name = "peft"
    Args = PeftArgs
    requires = ("torch", "transformers", "peft")

    def __init__(self, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]):
        super().__init__(model_dir, device, dtype, args)
        self.cfg = self.parse_args(self.args)
        if (self.base_quant != "none") != (self.cfg.activations == "int8"):
            raise UnsupportedFeatureError(
                f"peft engine: activations={self.cfg.activations} on a {self.base_quant} base; it holds a GGUF base "
                "(q8_0, q4_k) only with activations=int8, and activations=int8 only on one")
        import torch

        self._torch = torch
        self._dtype = torch_dtype(dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            # Pads are masked out, so any id works; EOS is the usual stand-in.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.is_encoder = is_encoder_only(self.model_dir)
        self._base = self._load_base()
        self._model = None  # the PeftModel, created by the first load_adapter
        self._adapters: dict[str, AdapterInfo] = {}
        self.capabilities = self._capabilities(self.is_encoder)
        self.limits = self.declared_limits(self.cfg, self.model_dir, device)

    @classmethod
    def declared_capabilities(cls, cfg: PeftArgs, model_dir: Optional[Path], device: str) -> frozenset:
        return cls._capabilities(model_dir is not None and is_encoder_only(Path(model_dir)))

    @classmethod
    def declared_limits(cls, cfg: PeftArgs, model_dir: Optional[Path], device: str) -> Limits:
        return Limits(max_loras_per_batch=64, max_loaded_loras=1024, max_rank=MAX_RANK)

    @staticmethod
    def _capabilities(is_encoder: bool) -> frozenset:
        caps = {
            Capability.DYNAMIC_LOADING,
            Capability.RSLORA,
            Capability.RANK_PATTERN,
            Capability.LORA_BIAS,
            Capability.MODULES_TO_SAVE,  # PEFT's ModulesToSaveWrapper routes rows per adapter too
        }
        if is_encoder:
            caps |= {Capability.EMBEDDINGS}
        else:
            caps |= {
                Capability.MIXED_BATCH,
                Capability.PROMPT_LOGPROBS,
                Capability.EMBED_TOKENS,
                Capability.LM_HEAD,
                Capability.MOE,  # single-adapter batches only, see the module docstring
            }
        return frozenset(caps)

    def _load_base(self):
        from transformers import AutoModel, AutoModelForCausalLM

        loader = AutoModel if self.is_encoder else AutoModelForCausalLM
        kwargs = {"dtype": self._dtype}
        if self.cfg.attn_implementation:
            kwargs["attn_implementation"] = self.cfg.attn_implementation
        try:
            base = loader.from_pretrained(str(self.model_dir), **kwargs)
        except (OSError, ValueError) as exc:
            raise EngineFailure(f"peft engine: cannot load {self.model_dir}: {exc}") from exc
        if self.cfg.activations == "int8":
            self._quantise_activations(base)
        head = base.get_output_embeddings() if not self.is_encoder else None
        if head is not None:
            # generate() hands the head the last position as a strided view of the hidden states; torch's
            # cpu matmul in float16/bfloat16 with a frozen weight (PEFT freezes the base) takes a slow path
            # on it: 24 s instead of 0.05 s for 16 rows x a 151,936 vocabulary (torch 2.13), with memory
            # growing meanwhile. The same values, contiguous.
            head.register_forward_pre_hook(lambda m, args: (args[0].contiguous(),) + tuple(args[1:]))
        return base.to(self.device).eval()

    @classmethod
    def declared_activations(cls, cfg: PeftArgs, model_dir: Optional[Path], device: str,
                             dtype: Optional[str] = None) -> Optional[str]:
        from lora_conformance.models.quant import gguf_activations

        return gguf_activations(model_dir) if cfg.activations == "int8" else None

    def _quantise_activations(self, base) -> None:
        """A forward pre-hook on each linear whose weight the checkpoint quantised: its input through
        the activation quantiser (layers/gguf_base.py). PEFT keeps the module as its LoRA layer's
        ``base_layer``, so the LoRA factors read the input unquantised."""
        from lora_conformance.engines.builtin.layers.gguf_base import quantizer
        from lora_conformance.models.quant import GGUF_ACTIVATIONS, read_manifest

        fn = quantizer(GGUF_ACTIVATIONS[self.base_quant])
        quantised = set((read_manifest(self.model_dir) or {"tensors": {}})["tensors"])
        hooked = 0
        for name, mod in base.named_modules():
            if isinstance(mod, self._torch.nn.Linear) and f"{name}.weight" in quantised:
                mod.register_forward_pre_hook(lambda m, args: (fn(args[0]),) + tuple(args[1:]))
                hooked += 1
        if not hooked:
            raise EngineFailure(f"peft engine: activations=int8, but no linear of {self.model_dir} is named as a "
                                "quantised tensor in its manifest")

    # ---- adapters -------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path, pinned: bool = False) -> None:
        """Transactional: a refused load leaves the engine as it was (same adapters, same outputs).

        The shared validator runs before PEFT sees anything; a reload of a loaded name that PEFT
        still refuses restores the previous adapter from its directory."""
        # pinned is accepted and meaningless: nothing is ever evicted here.
        from lora_conformance.adapters.validate import validate_adapter, validate_name

        validate_name(name)
        validate_adapter(Path(path), self.model_dir, MAX_RANK, self.dtype)
        info = read_adapter_info(Path(path))
        old = self._adapters.get(name)
        # Replace: the new weights must not mix with the old; a refused one puts the old back.
        replace_or_restore(name, Path(path), None if old is None else old.path, lambda: self.unload_adapter(name),
                           lambda p: self._load_into_peft(name, p, info if old is None or p != old.path else old),
                           restore_errors=(Exception,))

    def _load_into_peft(self, name: str, path: Path, info: AdapterInfo) -> None:
        from peft import LoraConfig, PeftModel

        try:
            config = LoraConfig.from_pretrained(str(path))
        except Exception as exc:
            raise AdapterIncompatibleError(f"adapter {name!r} from {path}: PEFT cannot read its config ({exc})") \
                from exc
        if config.task_type is None:
            # Without a task type PeftModel has no generate() that understands adapter_names.
            config.task_type = "FEATURE_EXTRACTION" if self.is_encoder else "CAUSAL_LM"
        config.inference_mode = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if self._model is None:
                    self._model = PeftModel.from_pretrained(
                        self._base, str(path), adapter_name=name, config=config, is_trainable=False
                    )
                    missing = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
                else:
                    result = self._model.load_adapter(str(path), adapter_name=name, is_trainable=False)
                    # PEFT filters missing keys by substring, so adapter "B" also "misses" adapter
                    # A's "lora_B.A.weight"; keep the keys whose dotted path names this adapter.
                    missing = [k for k in result.missing_keys if name in k.split(".")]
            except Exception as exc:  # PEFT, safetensors and torch raise many kinds; all mean "refused"
                self._forget_partial(name)
                raise AdapterIncompatibleError(f"adapter {name!r} from {path}: {type(exc).__name__}: {exc}") from exc
        if missing:
            self._forget_partial(name)
            raise AdapterIncompatibleError(f"adapter {name!r} from {path}: weights missing for {missing[:3]}")
        self._model.to(self.device).eval()
        self._adapters[name] = info
        self._fill_modules_to_save_gaps()

    def _fill_modules_to_save_gaps(self) -> None:
        """Give every adapter an entry in every modules_to_save wrapper.

        PEFT's mixed-batch forward of a ModulesToSaveWrapper looks each row's adapter up in
        its ``modules_to_save`` dict and raises KeyError for an adapter that has no copy of
        that module (peft 0.21). An adapter without a copy means "the base module", so the
        base module itself (shared, not copied) is registered under its name: exact, and
        free of memory cost.
        """
        from peft.utils.other import ModulesToSaveWrapper

        for module in self._model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                for adapter in self._adapters:
                    if adapter not in module.modules_to_save:
                        module.modules_to_save[adapter] = module.original_module

    def _forget_partial(self, name: str) -> None:
        if self._model is None:
            # The first load failed half-way: PEFT injects layers into the base model in
            # place, so the only clean state is a fresh copy from disk.
            self._base = self._load_base()
            return
        if name in self._model.peft_config:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    self._model.delete_adapter(name)
                except Exception:
                    # Half-injected: drop the config and whatever layers got the name.
                    self._model.peft_config.pop(name, None)
                    for module in self._model.modules():
                        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "scaling", "r",
                                     "lora_alpha", "lora_dropout"):
                            store = getattr(module, attr, None)
                            if isinstance(store, dict) or hasattr(store, "pop"):
                                try:
                                    store.pop(name, None)
                                except TypeError:
                                    pass
        if not self._model.peft_config:
            self._base = self._model.unload().eval()
            self._model = None

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoadedError(name, self.list_adapters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "adapter X was active, now Y": expected, we route per batch
            self._model.delete_adapter(name)
        info = self._adapters.pop(name)
        if info.target_parameters and self._adapters and not any(
            a.target_parameters for a in self._adapters.values()
        ):
            # PEFT leaves its parameter wrappers in place after delete_adapter, and they
            # refuse adapter_names for every batch; rebuild so mixed batches work again.
            keep = dict(self._adapters)
            self._adapters.clear()
            self._base = self._model.unload().eval()
            self._model = None
            for n, a in keep.items():
                self.load_adapter(n, a.path)
            return
        if not self._adapters:
            # PEFT keeps a stale active adapter once the last one is gone; unwrap to the
            # plain base model instead (unload() restores the original modules, no merge).
            self._base = self._model.unload().eval()
            self._model = None

    def list_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def engine_adapters(self) -> list[str]:
        """PEFT's own registry: the adapter configs the PeftModel holds."""
        model = getattr(self, "_model", None)
        return sorted(getattr(model, "peft_config", None) or {})

    # ---- generation -----------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self.is_encoder:
            raise UnsupportedFeatureError(f"{self.model_dir} is an encoder: use embed()")
        if not requests:
            return []
        torch = self._torch
        names = [r.adapter for r in requests]
        for n in names:
            if n is not None and n not in self._adapters:
                raise AdapterNotLoadedError(n, self.list_adapters())
        tok = self.tokenizer
        enc = tok([r.prompt for r in requests], return_tensors="pt", padding=True, padding_side="left")
        input_ids = enc["input_ids"].to(self.device)
        mask = enc["attention_mask"].to(self.device)
        steps = max(r.max_new_tokens for r in requests)
        k = max(r.top_k for r in requests)
        with self._routing(names) as (model, route_kwargs), torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1,
                max_new_tokens=steps,
                eos_token_id=None,  # never stop early; ignore_eos=False is applied below
                pad_token_id=tok.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
                **route_kwargs,
            )
            prompt_lps = self._prompt_logprobs(model, route_kwargs, requests, input_ids, mask, k)
        new = out.sequences[:, input_ids.shape[1]:]
        if new.shape[1] != steps or len(out.logits) != steps:
            raise EngineFailure(f"peft engine: generate() stopped after {new.shape[1]} of {steps} steps")
        logprobs = [torch.log_softmax(step.float(), dim=-1) for step in out.logits]
        results = []
        for i, req in enumerate(requests):
            ids = new[i, : req.max_new_tokens].tolist()
            tops: list[TopK] = []
            for s, tid in enumerate(ids):
                row = logprobs[s][i]
                if row[tid] < row.max():
                    raise EngineFailure(
                        f"peft engine: step {s} of request {i} chose token {tid} but the argmax is "
                        f"{int(row.argmax())}: the checkpoint's generation_config alters greedy decoding"
                    )
                tops.append(topk_from_logprobs(row, req.top_k))
            if not req.ignore_eos and tok.eos_token_id in ids:
                cut = ids.index(tok.eos_token_id) + 1  # EOS included, as vLLM reports it
                ids, tops = ids[:cut], tops[:cut]
            prompt_ids = input_ids[i][mask[i].bool()].tolist()
            results.append(
                GenerationResult(
                    token_ids=ids,
                    text=tok.decode(ids, skip_special_tokens=True),
                    logprobs=tops,
                    prompt_token_ids=prompt_ids,
                    prompt_logprobs=None if prompt_lps[i] is None else [
                        dict(list(t.items())[: req.top_k]) for t in prompt_lps[i]
                    ],
                )
            )
        return results

    def _prompt_logprobs(self, model, route_kwargs, requests, input_ids, mask, k) -> list[Optional[list[TopK]]]:
        """One forward over the padded prompts, same routing and positions as generation."""
        wanted = [i for i, r in enumerate(requests) if r.prompt_logprobs]
        found: list[Optional[list[TopK]]] = [None] * len(requests)
        if not wanted:
            return found
        torch = self._torch
        rows = torch.tensor(wanted, device=input_ids.device)
        sub_mask = mask[rows]
        positions = (sub_mask.long().cumsum(-1) - 1).clamp(min=0)
        kwargs = dict(route_kwargs)
        if "adapter_names" in kwargs:
            kwargs["adapter_names"] = [kwargs["adapter_names"][i] for i in wanted]
        logits = model(input_ids=input_ids[rows], attention_mask=sub_mask, position_ids=positions, **kwargs).logits
        lps = torch.log_softmax(logits.float(), dim=-1)
        for j, i in enumerate(wanted):
            start = int((sub_mask[j] == 0).sum())  # left padding length
            # Position p predicts token p+1: the last prompt position predicts the first output.
            found[i] = [topk_from_logprobs(lps[j, p], k) for p in range(start, lps.shape[1] - 1)]
        return found

    def _routing(self, names: list[Optional[str]]):
        """A context manager yielding (model, extra generate kwargs) for this batch's adapters."""
        import contextlib

        used = {n for n in names if n is not None}
        model = self._model
        if model is None:
            return contextlib.nullcontext((self._base, {}))
        blockers = sorted(n for n in self._adapters if self._adapters[n].target_parameters)
        blockers += sorted(n for n in used if self._adapters[n].use_dora)
        if not blockers:
            return contextlib.nullcontext((model, {"adapter_names": [n if n is not None else BASE for n in names]}))
        if len(set(names)) > 1:
            raise UnsupportedFeatureError(
                f"PEFT cannot mix adapters in one batch while {', '.join(blockers)} "
                "(DoRA or target_parameters) is loaded/used; send one adapter per batch"
            )
        return self._single(names[0])

    def _single(self, name: Optional[str]):
        import contextlib

        model = self._model

        @contextlib.contextmanager
        def ctx():
            if name is None:
                with model.disable_adapter():
                    yield model, {}
            else:
                model.set_adapter(name)
                yield model, {}

        return ctx()

    # ---- embeddings -----------------------------------------------------------------

    def embed(self, texts: Sequence[str], adapter: Optional[str] = None) -> list[list[float]]:
        if not self.is_encoder:
            raise UnsupportedFeatureError(f"peft engine: {self.model_dir} is not an encoder; no embeddings")
        if adapter is not None and adapter not in self._adapters:
            raise AdapterNotLoadedError(adapter, self.list_adapters())
        if not texts:
            return []
        torch = self._torch
        # Right padding: encoders use absolute positions counted from the first token.
        enc = self.tokenizer(list(texts), return_tensors="pt", padding=True, padding_side="right")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with self._routing([adapter] * len(texts)) as (model, kwargs), torch.inference_mode():
            hidden = model(**enc, **kwargs).last_hidden_state.float()
        m = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1).tolist()

    # ---- misc -------------------------------------------------------------------------

    def close(self) -> None:
        from lora_conformance import parallel

        self._model = None
        self._base = None
        self._adapters.clear()
        parallel.release_freed_memory()  # the model's pages back to the system, not kept by the allocator

    def version(self) -> str:
        import peft
        import transformers

        return f"peft {peft.__version__}, transformers {transformers.__version__}, torch {self._torch.__version__}"
