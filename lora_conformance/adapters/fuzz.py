"""Fuzzing engines with adapter directories: hypothesis strategies for mutations of a valid
adapter (config fields, tensor names, shapes, dtypes, values, the file's bytes), a function that
applies them, and the per-input verdict used by tests/test_fuzz_adapters.py and
bench/fuzz_adapters.py.

The invariant: whatever the input, the engine either refuses it with a typed EngineError
(not EngineFailure) or accepts it, and in both cases the base model and the adapters loaded
before give bit-identical outputs afterwards, with the same adapter list. hypothesis is
imported inside ``mutations()`` only (it is a test dependency).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from lora_conformance.checkpoints import ADAPTER_CONFIG as CONFIG

WEIGHTS = "adapter_model.safetensors"
CONFIG_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
                 "target_parameters", "layers_to_transform", "bias", "peft_type", "use_dora", "modules_to_save",
                 "lora_bias", "fan_in_fan_out")
DTYPES = ("float16", "bfloat16", "float64", "int32", "int8", "bool")
SPECIALS = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.0, 1e-45, 1e5, 7e4, 1e300)
# Module-name patterns as PEFT reads them: whole-name regexes for a string target_modules (some
# match nothing, or containers, or leave tensors untargeted, or are fine), and pattern keys on which
# a backtracking matcher runs for minutes.
TARGET_REGEXES = (".*", "^nomatch$", "q_proj", r".*\.q_proj", r".*\.v_proj", r".*\.(q_proj|v_proj)", r".*_proj",
                  r"model\.layers\.0\.self_attn\.q_proj", r"(.*.*)*z", "[", r".*\.(q|v)_proj")
PATTERN_KEYS = ("q_proj", "v_proj", r"layers\.0\..*", r"(.*.*)*z", r".*.*.*.*.*.*.*.*.*.*.*.*z", r"(.*){1,300}[bc]",
                "(", "")
OUTCOMES = ("refused", "accepted", "damaged", "untyped")


def mutations():
    """A hypothesis strategy: a list of 1-3 mutations, each a small tuple (op, ...)."""
    from hypothesis import strategies as st

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.sampled_from([0, 1, -1, 8, 300]),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                          st.sampled_from(["q_proj", "v_proj", "not_a_module", "LORA", "none", "all", ".*"]))
    json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=3)), max_leaves=6)
    index = st.integers(0, 10_000)
    op = st.one_of(
        st.tuples(st.just("set_field"), st.sampled_from(CONFIG_FIELDS), json_value),
        st.tuples(st.just("drop_field"), st.sampled_from(CONFIG_FIELDS)),
        st.tuples(st.just("config_is"), json_value),
        st.tuples(st.just("config_bytes"), st.binary(max_size=40)),
        st.tuples(st.just("rename"), index, st.sampled_from(
            ["swap_ab", "drop_prefix", "other_layer", "other_module", "bad_suffix", "random"]), st.text(max_size=10)),
        st.tuples(st.just("reshape"), index, st.sampled_from(["grow_in", "grow_out", "shrink", "transpose", "flat",
                                                              "cube", "empty"]), st.integers(1, 24)),
        st.tuples(st.just("dtype"), index, st.sampled_from(DTYPES)),
        st.tuples(st.just("value"), index, index, st.sampled_from(SPECIALS)),
        st.tuples(st.just("drop_tensor"), index),
        st.tuples(st.just("extra_tensor"), st.text(max_size=20), st.integers(0, 3)),
        st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),
        st.tuples(st.just("flip_byte"), index, st.integers(1, 255)),
        st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete_weights")),
        st.tuples(st.just("set_field"), st.just("target_modules"), st.sampled_from(TARGET_REGEXES)),
        st.tuples(st.just("set_field"), st.sampled_from(["rank_pattern", "alpha_pattern"]),
                  st.dictionaries(st.sampled_from(PATTERN_KEYS), st.sampled_from([1, 4, 8, 16, 2.0, 1e300]),
                                  min_size=1, max_size=2)),
        st.tuples(st.just("set_field"), st.just("lora_alpha"), st.sampled_from([1e300, 1e38, 6e4, -16, 0])),
        st.tuples(st.just("widen"), index, st.sampled_from([1e300, 1e39, 1e5, 7e4])),
    )
    return st.lists(op, min_size=1, max_size=3)


def apply_mutations(good: Path, out: Path, ops: list[tuple]) -> Path:
    """Copy ``good`` to ``out`` and apply ``ops`` in order (each op tolerates the others' damage)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(good, out)
    for op in ops:
        try:
            _apply(out, op)
        except Exception:  # noqa: BLE001 - safetensors raises its own error type
            pass  # an earlier op made this one impossible (weights gone or unreadable, config not an object)
    return out


def _apply(d: Path, op: tuple) -> None:
    kind = op[0]
    cfg_file, w = d / CONFIG, d / WEIGHTS
    if kind in ("set_field", "drop_field"):
        cfg = json.loads(cfg_file.read_text())
        if kind == "set_field":
            cfg[op[1]] = op[2]
        else:
            cfg.pop(op[1], None)
        cfg_file.write_text(json.dumps(cfg))
    elif kind == "config_is":
        cfg_file.write_text(json.dumps(op[1]))
    elif kind == "config_bytes":
        cfg_file.write_bytes(op[1])
    elif kind in ("truncate", "flip_byte", "append"):
        raw = bytearray(w.read_bytes())
        if kind == "truncate":
            raw = raw[: int(len(raw) * op[1])]
        elif kind == "flip_byte" and raw:
            raw[op[1] % len(raw)] ^= op[2]
        else:
            raw += op[1]
        w.write_bytes(bytes(raw))
    elif kind == "delete_weights":
        w.unlink()
    else:
        _apply_tensor_op(w, op)


def _apply_tensor_op(w: Path, op: tuple) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    ts = load_file(str(w))
    keys = sorted(ts)
    kind = op[0]
    if kind == "extra_tensor":
        ts[f"base_model.model.{op[1]}" if op[2] % 2 else op[1] or "x"] = torch.randn(op[2] + 1, 4)
    elif not keys:
        return
    else:
        key = keys[op[1] % len(keys)]
        t = ts[key]
        if kind == "rename":
            how, text = op[2], op[3]
            new = {"swap_ab": key.replace("lora_A", "lora_#").replace("lora_B", "lora_A").replace("lora_#", "lora_B"),
                   "drop_prefix": key.replace("base_model.model.", "", 1),
                   "other_layer": key.replace("layers.0.", "layers.97.").replace("layers.1.", "layers.98."),
                   "other_module": key.replace("q_proj", "k_proj").replace("v_proj", "o_proj"),
                   "bad_suffix": key.replace(".weight", ".wieght"),
                   "random": text or "?"}[how]
            ts[new] = ts.pop(key)
        elif kind == "reshape":
            how, n = op[2], op[3]
            if how == "grow_in" and t.dim() == 2:
                t = torch.cat([t, torch.zeros(t.shape[0], n, dtype=t.dtype)], dim=1)
            elif how == "grow_out" and t.dim() == 2:
                t = torch.cat([t, torch.zeros(n, t.shape[1], dtype=t.dtype)], dim=0)
            elif how == "shrink" and t.shape[0] > 1:
                t = t[: max(1, t.shape[0] - n)]
            elif how == "transpose" and t.dim() == 2:
                t = t.t()
            elif how == "flat":
                t = t.reshape(-1)
            elif how == "cube":
                t = t.reshape(1, *t.shape)
            elif how == "empty":
                t = t[:0]
            ts[key] = t.contiguous()
        elif kind == "dtype":
            ts[key] = t.to(getattr(torch, op[2]))
        elif kind == "value" and t.numel():
            t = t.clone()
            t.view(-1)[op[2] % t.numel()] = op[3]
            ts[key] = t
        elif kind == "drop_tensor":
            del ts[key]
        elif kind == "widen" and t.numel():  # stored as float64: finite there, maybe not in the engine's dtype
            t = t.to(torch.float64).clone()
            t.view(-1)[0] = op[2]
            ts[key] = t
    save_file({k: v.contiguous() for k, v in ts.items()}, str(w))


def try_input(engine, before, path: Path, name: str = "F") -> tuple[str, str]:
    """(outcome, detail) for one input on ``engine`` whose healthy state is the snapshot ``before``."""
    from lora_conformance.judge.health import Snapshot, differences, generate_per_adapter
    from lora_conformance.errors import EngineError, EngineFailure

    detail = ""
    try:
        engine.load_adapter(name, path)
        outcome = "accepted"
    except EngineFailure as exc:
        outcome, detail = "untyped", f"EngineFailure (a crash, not a refusal): {exc}"
    except EngineError as exc:
        outcome, detail = "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - what the fuzzer exists to find
        outcome, detail = "untyped", f"{type(exc).__name__}: {exc}"
    if name in engine.list_adapters():
        try:  # serve it beside the base, as a user would, then take it out again
            engine.generate([before.requests[0], replace(before.requests[0], adapter=name)])
        except EngineError:
            pass  # an engine may refuse to serve what it loaded; what matters is the state after
        except Exception as exc:  # noqa: BLE001
            outcome, detail = "untyped", f"serving the accepted adapter: {type(exc).__name__}: {exc}"
        engine.unload_adapter(name)
    try:
        names = sorted(engine.list_adapters())
        after = Snapshot(names, before.requests,
                         generate_per_adapter(engine, before.requests) if names == before.adapters else [])
        problems = differences(before, after)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot serve any more is damaged
        problems = [f"{type(exc).__name__}: {exc}"]
    if problems:
        return "damaged", "; ".join(problems[:3]) + (f" (after: {detail})" if detail else "")
    return outcome, detail

