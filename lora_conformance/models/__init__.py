"""Offline base models: ``synthetic:llama|moe|encoder`` built on demand and cached, or a local directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Union

from lora_conformance.checkpoints import model_kind  # the one rule; the harness asks it here
from lora_conformance.fileio import build_directory_once
from lora_conformance.settings import fixtures_dir

# (stdlib only: the plugin validates --base-model with it) synthetic.DECODER_KINDS + encoder
SYNTHETIC_KINDS = ("llama", "moe", "encoder", "llama-hd128", "llama-hd256", "qwen2",
                   "qwen2.5-1.5b", "qwen2.5-7b", "moe-64e")
# Real shapes (profile full): billions of parameters, built in minutes on a big host (not in cpu tests).
REAL_SHAPE_KINDS = ("qwen2.5-1.5b", "qwen2.5-7b", "moe-64e")
SMALL_KINDS = tuple(k for k in SYNTHETIC_KINDS if k not in REAL_SHAPE_KINDS)
# --base-quant's choices (stdlib only, like the kinds): models.quant.SCHEMES describes each
BASE_QUANT_SCHEMES = ("none", "int8", "q8_0", "q4_k", "ov_int8", "ov_int4")
HASH_FILE = ".content_hash"
_HASHED = ("config.json", "tokenizer.json", "tokenizer_config.json")


def _recipe(kind: str, seed: int = 0) -> dict:
    from lora_conformance.models import synthetic

    return synthetic.recipe_for(kind, seed)


def build_synthetic(kind: str, out: Path, seed: int = 0) -> Path:
    """Build ``synthetic:<kind>`` into ``out`` (no caching)."""
    from lora_conformance.models import synthetic

    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"model kind: expected one of {', '.join(SYNTHETIC_KINDS)}, got {kind!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    synthetic.build(kind, out, seed)
    return out


def resolve_base_model(spec: str, cache_dir: Union[str, Path], seed: int = 0) -> Path:
    """A checkpoint directory for ``spec``: ``synthetic:<kind>`` (built once, cached) or a local path."""
    if spec.startswith("synthetic:"):
        kind = spec.split(":", 1)[1]
        if kind not in SYNTHETIC_KINDS:
            raise ValueError(_accepted(spec))
        return _cached_build(kind, Path(cache_dir), seed)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"base model directory {path} has no config.json")
        return path
    raise ValueError(_accepted(spec))


def check_base_model_spec(spec: str) -> str:
    """``--base-model``'s value, unchanged, before anything is built: a known ``synthetic:<kind>`` or
    a directory with a config.json (ValueError otherwise, listing what is accepted). No torch here."""
    kinds = ", ".join(f"synthetic:{k}" for k in SYNTHETIC_KINDS)
    if spec.startswith("synthetic:"):
        if spec.split(":", 1)[1] not in SYNTHETIC_KINDS:
            raise ValueError(f"expected {kinds}, or a local HF checkpoint directory")
    elif not (Path(spec) / "config.json").is_file():
        raise ValueError(f"not a synthetic:* model and no config.json in that directory (expected {kinds}, "
                         "or a local HF checkpoint directory)")
    return spec


def _accepted(spec: str) -> str:
    kinds = ", ".join(f"synthetic:{k}" for k in SYNTHETIC_KINDS)
    return f"unknown base model {spec!r}; expected one of {kinds}, or an existing local checkpoint directory"


def _cached_build(kind: str, cache_dir: Path, seed: int) -> Path:
    key = hashlib.sha256(json.dumps(_recipe(kind, seed), sort_keys=True).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        build_synthetic(kind, tmp, seed)
        content_hash(tmp)

    return build_directory_once(cache_dir / "models" / f"synthetic-{kind}-{key}",
                                lambda d: (d / "config.json").is_file(), build)


def transformers_files_key(model_dir: Union[str, Path], names: tuple[str, ...], extra: str = "") -> Optional[str]:
    """A short key for what transformers derives from these files of a checkpoint (the base shapes,
    AutoTokenizer's class choice): their contents (a missing file counts as missing), the installed
    transformers version and ``extra``; None where transformers is not installed."""
    from importlib import metadata

    try:
        h = hashlib.sha256(f"transformers={metadata.version('transformers')}|{extra}".encode())
    except metadata.PackageNotFoundError:
        return None
    for name in names:
        path = Path(model_dir) / name
        h.update(f"|{name}=".encode())
        if path.exists():
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:24]


def content_hash(model_dir: Union[str, Path]) -> str:
    """sha256 over config, weights and tokenizer files; cached in ``.content_hash``."""
    model_dir = Path(model_dir)
    files = sorted(
        p for p in model_dir.iterdir() if p.name in _HASHED or p.suffix == ".safetensors" or p.name.endswith(".bin")
    )
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    cached = model_dir / HASH_FILE
    if cached.is_file():
        saved_stamp, _, digest = cached.read_text().partition("\n")
        if saved_stamp == stamp:
            return digest.strip()
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()
    try:  # atomic: a concurrent reader must never take a half-written digest for the stamp's
        from lora_conformance.fileio import write_text_atomic

        write_text_atomic(cached, f"{stamp}\n{digest}")
    except OSError:
        pass  # read-only checkouts still get the hash
    return digest


def default_prompts() -> list[str]:
    return list(json.loads((fixtures_dir() / "prompts.json").read_text()))


def load_model(model_dir: Union[str, Path], dtype=None):
    """The HF model for a checkpoint dir (causal LM for decoders, AutoModel for encoders)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    dtype = dtype or torch.float32
    if model_kind(model_dir) == "encoder":
        return AutoModel.from_pretrained(str(model_dir), dtype=dtype, add_pooling_layer=False).eval()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
