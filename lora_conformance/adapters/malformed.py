"""Malformed adapter directories, made from a valid one, for the bad-input suite and the fuzzers.

Each kind is a function ``(good_dir, out_dir, max_rank) -> out_dir`` that copies the valid
adapter and breaks exactly one thing. ``MALFORMED`` maps the kind's name to the function and to
the field an engine's error should be about (what a user would need to fix).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from lora_conformance.checkpoints import ADAPTER_CONFIG as CONFIG

WEIGHTS = "adapter_model.safetensors"


def _copy(good: Path, out: Path) -> Path:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(good, out)
    return out


def _config(d: Path) -> dict:
    return json.loads((d / CONFIG).read_text())


def _write_config(d: Path, cfg) -> None:
    (d / CONFIG).write_text(json.dumps(cfg, indent=1))


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(d / WEIGHTS))


def _write_tensors(d: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / WEIGHTS))


def _first(tensors: dict, suffix: str) -> str:
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def truncated_weights(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(raw[: len(raw) // 2])
    return d


def not_safetensors(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    (d / WEIGHTS).write_bytes(b"this is not a safetensors file\n" * 4)
    return d


def missing_weights(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    (d / WEIGHTS).unlink()
    return d


def config_not_json(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    (d / CONFIG).write_text('{"r": 8, "lora_alpha": ')
    return d


def config_not_utf8(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    (d / CONFIG).write_bytes(b'{"r": 8, "peft_type": "LORA\xff\xfe"}')
    return d


def config_not_object(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    _write_config(d, [1, 2, 3])
    return d


def rank_zero(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    _write_config(d, {**_config(d), "r": 0})
    return d


def shapes_of_another_model(good: Path, out: Path, max_rank: int) -> Path:
    """Every lora_A gets 16 more input features, every lora_B 16 more outputs (a wider model)."""
    import torch

    d = _copy(good, out)
    ts = _tensors(d)
    for k, t in list(ts.items()):
        if k.endswith("lora_A.weight"):
            ts[k] = torch.cat([t, torch.zeros(t.shape[0], 16, dtype=t.dtype)], dim=1)
        elif k.endswith("lora_B.weight"):
            ts[k] = torch.cat([t, torch.zeros(16, t.shape[1], dtype=t.dtype)], dim=0)
    _write_tensors(d, ts)
    return d


def _poison(value: float):
    def make(good: Path, out: Path, max_rank: int) -> Path:
        d = _copy(good, out)
        ts = _tensors(d)
        k = _first(ts, "lora_B.weight")
        ts[k] = ts[k].clone()
        ts[k].view(-1)[0] = value
        _write_tensors(d, ts)
        return d

    return make


def rank_over_limit(good: Path, out: Path, max_rank: int) -> Path:
    """Consistent config and tensors (zero-padded to rank 2 x max_rank), over the engine's limit."""
    import torch

    d = _copy(good, out)
    cfg = _config(d)
    r = 2 * max_rank
    ts = _tensors(d)
    for k, t in list(ts.items()):
        if k.endswith("lora_A.weight"):
            ts[k] = torch.cat([t, torch.zeros(r - t.shape[0], t.shape[1], dtype=t.dtype)], dim=0)
        elif k.endswith("lora_B.weight"):
            ts[k] = torch.cat([t, torch.zeros(t.shape[0], r - t.shape[1], dtype=t.dtype)], dim=1)
    cfg.update(r=r, rank_pattern={}, alpha_pattern={})
    _write_tensors(d, ts)
    _write_config(d, cfg)
    return d


def unknown_target_module(good: Path, out: Path, max_rank: int) -> Path:
    """The config targets a module the base model does not have."""
    d = _copy(good, out)
    cfg = _config(d)
    cfg["target_modules"] = list(cfg.get("target_modules") or []) + ["not_a_module_proj"]
    _write_config(d, cfg)
    return d


def unknown_tensor_module(good: Path, out: Path, max_rank: int) -> Path:
    """One module's tensors are renamed to a module the base model does not have."""
    d = _copy(good, out)
    ts = _tensors(d)
    k = _first(ts, "lora_A.weight")
    mod = k[: -len(".lora_A.weight")]
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        ts[mod.rsplit(".", 1)[0] + ".not_a_module_proj" + suffix] = ts.pop(mod + suffix)
    _write_tensors(d, ts)
    return d


def missing_lora_b(good: Path, out: Path, max_rank: int) -> Path:
    d = _copy(good, out)
    ts = _tensors(d)
    del ts[_first(ts, "lora_B.weight")]
    _write_tensors(d, ts)
    return d


def config_rank_mismatch(good: Path, out: Path, max_rank: int) -> Path:
    """adapter_config.json says another r than the tensors' rank (PEFT would scale by the wrong r):
    twice it, or half it where twice would pass ``max_rank``. The adapter is wrong in this one way:
    a config r over the engine's limit would be refused for that instead, and an engine that never
    compares r with the tensors would pass."""
    d = _copy(good, out)
    cfg = _config(d)
    r = int(cfg.get("r", 8))
    wrong = next((w for w in (2 * r, r // 2, r + 1, r - 1) if 1 <= w <= max_rank and w != r), None)
    if wrong is None:
        raise ValueError(f"config_rank_mismatch: no rank other than {r} within max_rank {max_rank}")
    cfg.update(r=wrong, rank_pattern={})
    _write_config(d, cfg)
    return d


def integer_tensors(good: Path, out: Path, max_rank: int) -> Path:
    import torch

    d = _copy(good, out)
    ts = _tensors(d)
    k = _first(ts, "lora_A.weight")
    ts[k] = ts[k].to(torch.int32)
    _write_tensors(d, ts)
    return d


def float64_overflows_compute_dtype(good: Path, out: Path, max_rank: int) -> Path:
    """lora_B stored as float64 with one 1e300: finite as stored, Inf in any engine's float32 or
    narrower pool, where a masked batched GEMM (0 * Inf = NaN) would poison every other row."""
    import torch

    d = _copy(good, out)
    ts = _tensors(d)
    k = _first(ts, "lora_B.weight")
    ts[k] = ts[k].to(torch.float64).clone()
    ts[k].view(-1)[0] = 1e300
    _write_tensors(d, ts)
    return d


def alpha_overflows_compute_dtype(good: Path, out: Path, max_rank: int) -> Path:
    """lora_alpha 1e300: a finite JSON number whose scaling alpha/r is Inf in float32."""
    d = _copy(good, out)
    _write_config(d, {**_config(d), "lora_alpha": 1e300})
    return d


def _suffixes(d: Path) -> list[str]:
    return sorted({k[: -len(".lora_A.weight")].rsplit(".", 1)[1] for k in _tensors(d) if k.endswith(".lora_A.weight")})


def target_regex_matches_nothing(good: Path, out: Path, max_rank: int) -> Path:
    """A string target_modules is a whole-name regex (PEFT: re.fullmatch): this one matches no module."""
    d = _copy(good, out)
    _write_config(d, {**_config(d), "target_modules": "^nomatch$"})
    return d


def target_regex_matches_containers(good: Path, out: Path, max_rank: int) -> Path:
    """``.*`` matches every module, containers and norms too: PEFT refuses to wrap those."""
    d = _copy(good, out)
    _write_config(d, {**_config(d), "target_modules": ".*"})
    return d


def target_regex_leaves_tensors_untargeted(good: Path, out: Path, max_rank: int) -> Path:
    """The regex targets one of the module kinds the tensors cover: PEFT would silently ignore the
    others' tensors, an engine that applies them serves another adapter."""
    d = _copy(good, out)
    first = _suffixes(d)[0]
    _write_config(d, {**_config(d), "target_modules": rf".*\.{first}"})
    return d


def pattern_key_backtracks(good: Path, out: Path, max_rank: int) -> Path:
    """A rank_pattern key on which a backtracking matcher (Python's re, PEFT's) runs for minutes."""
    d = _copy(good, out)
    _write_config(d, {**_config(d), "rank_pattern": {"(.*){1,300}[bc]": 4}})
    return d


def header_overruns_file(good: Path, out: Path, max_rank: int) -> Path:
    """The safetensors header promises a tensor of 4 GiB at the end; the file is a sparse 4 GiB
    (no disk used): a loader that reads before it checks the header's shapes reads 4 GiB."""
    import struct

    d = _copy(good, out)
    raw = (d / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    k = _first({k: None for k in header if k != "__metadata__"}, "lora_B.weight")
    rows = (1 << 30) // 8
    header[k] = {"dtype": "F32", "shape": [rows, 8], "data_offsets": [len(data), len(data) + rows * 8 * 4]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(d / WEIGHTS, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)
        f.truncate(8 + len(head) + len(data) + rows * 8 * 4)
    return d


# kind -> (maker, what the error should name)
MALFORMED: dict[str, tuple[Callable[[Path, Path, int], Path], str]] = {
    "truncated_weights": (truncated_weights, WEIGHTS),
    "not_safetensors": (not_safetensors, WEIGHTS),
    "missing_weights": (missing_weights, "adapter_model"),
    "config_not_json": (config_not_json, CONFIG),
    "config_not_utf8": (config_not_utf8, CONFIG),
    "config_not_object": (config_not_object, CONFIG),
    "rank_zero": (rank_zero, "r"),
    "shapes_of_another_model": (shapes_of_another_model, "shape"),
    "nan_value": (_poison(float("nan")), "non-finite"),
    "inf_value": (_poison(float("inf")), "non-finite"),
    "rank_over_limit": (rank_over_limit, "rank"),
    "unknown_target_module": (unknown_target_module, "not_a_module_proj"),
    "unknown_tensor_module": (unknown_tensor_module, "not_a_module_proj"),
    "missing_lora_b": (missing_lora_b, "lora_B"),
    "config_rank_mismatch": (config_rank_mismatch, "rank"),
    "integer_tensors": (integer_tensors, "dtype"),
    "float64_overflows_compute_dtype": (float64_overflows_compute_dtype, "overflow"),
    "alpha_overflows_compute_dtype": (alpha_overflows_compute_dtype, "lora_alpha"),
    "target_regex_matches_nothing": (target_regex_matches_nothing, "target_modules"),
    "target_regex_matches_containers": (target_regex_matches_containers, "target_modules"),
    "target_regex_leaves_tensors_untargeted": (target_regex_leaves_tensors_untargeted, "target_modules"),
    "pattern_key_backtracks": (pattern_key_backtracks, "rank_pattern"),
    "header_overruns_file": (header_overruns_file, "shape"),
}

# Adapter names an engine must refuse: path separators, URL/route separators, whitespace, PEFT's base.
BAD_NAMES = ("../escape", "a/b", "a\\b", "base:adapter", "two words", "", "__base__", "new\nline")


def make_malformed(kind: str, good: Path, out: Path, max_rank: int) -> Path:
    if kind not in MALFORMED:
        raise KeyError(f"unknown malformed kind {kind!r}; known: {', '.join(MALFORMED)}")
    return MALFORMED[kind][0](Path(good), Path(out), max_rank)
