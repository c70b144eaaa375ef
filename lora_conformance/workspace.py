"""Where a session's models, adapters and references come from.

``Workspace`` resolves a base-model spec to a directory (synthesized offline on first use and
cached), an adapter spec to a PEFT directory, and a model to its HF + PEFT reference runner, each
once per process, all under the run's cache directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lora_conformance.settings import Settings

MODEL_KINDS = {"decoder": None, "llama": None, "moe": "synthetic:moe", "encoder": "synthetic:encoder",
               # base-model variants (suites/test_base_models.py): always these synthetic models
               "llama-hd128": "synthetic:llama-hd128", "llama-hd256": "synthetic:llama-hd256",
               "qwen2": "synthetic:qwen2"}


class Workspace:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._model_dirs: dict[str, Path] = {}
        self._kinds: dict[Path, str] = {}
        self._references: dict[Path, Any] = {}
        self._loaded = None  # the references' LoadedModels: one budget over this process's bases

    def model_spec(self, kind: Optional[str]) -> str:
        """``--base-model`` unless the suite needs another kind (moe, encoder) than it is."""
        if kind in (None, "decoder", "llama"):
            return self.settings.base_model
        if kind not in MODEL_KINDS:
            raise ValueError(f"unknown base_model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
        own = self.model_dir(self.settings.base_model)
        from lora_conformance.models import profiles  # the profile's model for the kind (moe), else the table's

        other = profiles.model_for(profiles.get(self.settings.profile), kind) or MODEL_KINDS[kind]
        return self.settings.base_model if self.kind_of(own) == kind else other

    def model_dir(self, spec: str) -> Path:
        if spec not in self._model_dirs:
            from lora_conformance.models import resolve_base_model

            self._model_dirs[spec] = self._quantized(resolve_base_model(spec, self.settings.cache_dir / "models"))
        return self._model_dirs[spec]

    def _quantized(self, model_dir: Path) -> Path:
        """--base-quant: a decoder base snapped through its scheme (models/quant.py); encoders stay float."""
        scheme = self.settings.base_quant
        if scheme == "none" or self.kind_of(model_dir) == "encoder":
            return model_dir
        from lora_conformance.models.quant import snapped_checkpoint

        return snapped_checkpoint(model_dir, scheme, self.settings.cache_dir / "models" / "quantized")

    def kind_of(self, model_dir: Path) -> str:
        if model_dir not in self._kinds:
            from lora_conformance.checkpoints import model_kind

            self._kinds[model_dir] = model_kind(model_dir)
        return self._kinds[model_dir]

    def adapter_path(self, model_dir: Path, spec) -> Path:
        from lora_conformance.adapters import synthesize_cached

        return synthesize_cached(model_dir, spec, self.settings.cache_dir / "adapters")

    def reference(self, model_dir: Path):
        if model_dir not in self._references:
            from lora_conformance.reference import ReferenceCache, ReferenceRunner
            from lora_conformance.reference.runner import LoadedModels

            s = self.settings
            self._loaded = self._loaded or LoadedModels()
            cache = ReferenceCache(s.cache_dir / "references", refresh=s.refresh_references)
            self._references[model_dir] = ReferenceRunner(model_dir, s.reference_device, s.reference_dtype, cache,
                                                          tokenizer_cache=s.cache_dir / "tokenizers",
                                                          loaded=self._loaded)
        return self._references[model_dir]

    def release_reference_models(self) -> None:
        """Every reference's loaded models dropped (``ReferenceRunner.release_models``)."""
        for runner in self._references.values():
            runner.release_models()

    def reference_work(self) -> dict[str, float]:
        """What this process's references computed and what it took, summed over its base models
        (``ReferenceRunner.work``); empty where no reference was asked for."""
        from lora_conformance.reference import sum_work

        return sum_work(runner.work() for runner in self._references.values())
