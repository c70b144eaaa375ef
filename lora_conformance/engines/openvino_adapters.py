"""PEFT adapters as OpenVINO GenAI takes them: (Adapter, alpha) pairs, and the modules they bind.

GenAI reads ``adapter_model.safetensors`` itself (``Adapter(path)``) and never reads
``adapter_config.json``. An ``AdapterConfig`` is a list of (Adapter, alpha) pairs; GenAI scales
every LoRA tensor of an Adapter by that pair's alpha ("only alpha from config is used":
``collect_applicable_tensors``, src/cpp/src/lora/adapter.cpp#L1536-L1552 at openvino.genai
da1db864) and sums the LoRA of every Adapter of the list that has tensors for a MatMul (its
multi-adapter blending: ``fine_grained_alpha``, one alpha per rank, #L240-L241, #L322). PEFT's
scaling comes from the config: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), which
``rank_pattern`` / ``alpha_pattern`` change per module (``checkpoints.peft_scaling``). So a PEFT
adapter reaches GenAI as:

* one pair, the file as it is with PEFT's scaling as alpha, when every module has the same
  scaling (no patterns, or patterns that change nothing): GenAI reads and judges the file itself;
* one pair per scaling otherwise: GenAI first reads the whole file (what it refuses, it refuses
  itself), then the file's tensors are split, byte for byte, into one safetensors blob per
  scaling (a module's A and B stay together), each an ``Adapter`` built from the blob
  (``Adapter(ov.Tensor)``, lora_adapter.hpp#L42) with that scaling as alpha. The groups share no
  module, so each module gets its own scaling and nothing else; no weight is changed.

A request for the adapter carries all of its pairs in its ``AdapterConfig``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from lora_conformance.checkpoints import ADAPTER_CONFIG, AdapterInfo, peft_scaling, split_lora_key
from lora_conformance.errors import AdapterFormatError

WEIGHTS = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def adapter_scaling(info: AdapterInfo) -> float:
    """PEFT's adapter-wide scaling (patterns not applied); GenAI's alpha for a file given whole."""
    if info.rank <= 0:
        raise AdapterFormatError(info.path / ADAPTER_CONFIG, "r",
                                 f"{info.rank}: the alpha passed to GenAI is lora_alpha / r, which needs r > 0")
    return peft_scaling(info.raw)  # a missing lora_alpha is PEFT's default, 8


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, unchecked beyond being a JSON object."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(min(n, MAX_HEADER_BYTES)).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return n, header


def adapter_modules(path: Path) -> set[str]:
    """Module paths (``model.layers.0.self_attn.q_proj``) a PEFT adapter file carries LoRA for, from
    the names in its safetensors header alone (the data is GenAI's to read and judge: a file whose
    data is cut short still names its tensors)."""
    _, header = _header(Path(path) / WEIGHTS)
    keys = [split_lora_key(name) for name in header if name != "__metadata__"]
    return {k.module for k in keys if k.factor and not k.embedding}


def module_scalings(info: AdapterInfo) -> dict[str, float]:
    """PEFT's scaling of every module the file carries LoRA factors for (patterns applied)."""
    _, header = _header(info.path / WEIGHTS)
    keys = [split_lora_key(name) for name in header if name != "__metadata__"]
    return {k.module: peft_scaling(info.raw, k.module) for k in keys if k.factor}


def split_by_module(path: Path, groups: list[set[str]]) -> list[bytes]:
    """The safetensors file at ``path`` as one safetensors blob per module group, byte for byte:
    each blob holds the LoRA factors of its group's modules; tensors that are no module's LoRA
    factor (a DoRA magnitude, a bias, a full copy) go with the first group."""
    from lora_conformance.adapters.weights import read_header

    read_header(path)  # byte ranges within the file (AdapterFormatError names what is wrong)
    n, header = _header(path)
    with open(path, "rb") as fh:
        fh.seek(8 + n)
        data = fh.read()
    chosen: list[dict[str, dict]] = [{} for _ in groups]
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        key = split_lora_key(name)
        index = next((i for i, g in enumerate(groups) if key.factor and key.module in g), 0)
        chosen[index][name] = entry
    blobs = []
    for entries in chosen:
        out_header, parts, offset = {}, [], 0
        for name, entry in entries.items():
            begin, end = entry["data_offsets"]
            out_header[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                                "data_offsets": [offset, offset + end - begin]}
            parts.append(data[begin:end])
            offset += end - begin
        if "__metadata__" in header:
            out_header["__metadata__"] = header["__metadata__"]
        head = json.dumps(out_header, separators=(",", ":")).encode("utf-8")
        head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
        blobs.append(struct.pack("<Q", len(head)) + head + b"".join(parts))
    return blobs


def genai_pairs(genai, info: AdapterInfo, whole) -> list[tuple[object, float]]:
    """The (``openvino_genai.Adapter``, alpha) pairs that serve ``info``'s adapter (module docstring);
    ``whole`` is GenAI's ``Adapter`` of the whole file (GenAI has read it: what it refuses, it refused)."""
    scalings = module_scalings(info) if info.has_rank_pattern else {}
    values = list(dict.fromkeys(scalings.values()))
    if len(values) <= 1:
        return [(whole, values[0] if values else adapter_scaling(info))]
    import numpy as np
    import openvino as ov

    groups = [{m for m, s in scalings.items() if s == v} for v in values]
    pairs = []
    for blob, value in zip(split_by_module(info.path / WEIGHTS, groups), values):
        tensor = ov.Tensor(np.frombuffer(blob, dtype=np.uint8).copy())
        pairs.append((genai.Adapter(tensor), value))
    return pairs
