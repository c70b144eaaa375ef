"""Reading an adapter's weights file without trusting its size: the safetensors header first.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, byte range) and the data. ``read_header`` reads and checks the header alone, so
the validator can refuse names, dtypes and shapes that do not fit the base model before a byte
of data is read: a multi-GiB file is refused in milliseconds, not after it was read whole. The
legacy pickle (``adapter_model.bin``) has no header; its size is bounded by what the base
model could need before it is opened.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Optional

from lora_conformance.errors import AdapterFormatError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# safetensors dtype names -> torch dtype names
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}


def read_header(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (torch dtype name, shape) from a safetensors file's header; the byte ranges are
    checked against the file's size (a truncated file is refused here)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise AdapterFormatError(f, "file", f"truncated ({size} bytes; a safetensors file starts with an "
                                                "8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise AdapterFormatError(f, "file", f"header length {n} exceeds the file ({size} bytes) or "
                                                f"{MAX_HEADER_BYTES} bytes: truncated or not a safetensors file")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AdapterFormatError(f, "file", f"header is not JSON ({exc}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterFormatError(f, "file", "header is not a JSON object: not a safetensors file")
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
              and isinstance(entry.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"]))
        if not ok:
            raise AdapterFormatError(f, name, "header entry is not {dtype, shape, data_offsets}")
        dtype = entry["dtype"]
        if dtype not in DTYPES:
            raise AdapterFormatError(f, name, f"dtype {dtype}; expected one of {', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * ITEMSIZE[dtype]:
            raise AdapterFormatError(f, name, f"byte range {begin}..{end} does not hold shape {entry['shape']} "
                                              f"of {dtype}")
        if end > data_bytes:
            raise AdapterFormatError(f, "file", f"truncated: {name} ends at byte {end} of the data, "
                                                f"which has {data_bytes}")
        out[name] = (DTYPES[dtype], tuple(entry["shape"]))
    return out


def meta_tensors(header: dict) -> dict:
    """Data-less tensors of the header's dtypes and shapes (for the structural checks)."""
    import torch

    return {name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for name, (dtype, shape) in header.items()}


def check_pickle_size(f: Path, limit: Optional[int]) -> None:
    size = f.stat().st_size
    if limit is not None and size > limit:
        raise AdapterFormatError(f, "file", f"{size} bytes, more than any adapter of this base model can hold "
                                            f"({limit} bytes): refused before reading it")


def file_sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
