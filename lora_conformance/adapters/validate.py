"""One validator for PEFT LoRA adapter directories, run by every engine we ship before it
touches its own state (so a refused load changes nothing).

It checks the config fields, the weights file (readable, not truncated; for safetensors the
header is checked against the base model before any data is read), every tensor's name, dtype,
shape against the base model, the rank each module's tensors carry against the config's ``r`` /
``rank_pattern``, and the engine's rank limit. Values are checked for finiteness *in the
engine's compute dtype*, after conversion: a float64 ``lora_B`` holding 1e300 is finite as
stored but inf in a float32 pool, where a masked batched GEMM (0 * inf = NaN) would spread it to
every other row; so are the scaling ``lora_alpha / r`` and ``lora_B * scaling`` (what engines
that fold the scaling into B store). Module-name patterns (a string ``target_modules``,
``rank_pattern``, ``alpha_pattern``) follow PEFT's semantics and are matched in bounded time
(``patterns.py``). Anything wrong raises ``AdapterFormatError`` naming the file and the field. It decides *format*, not *support*:
DoRA, ``modules_to_save`` and LoRA biases are well-formed and pass here; engines refuse them
with UnsupportedFeatureError.

The base model's module shapes come from its ``config.json`` through transformers on the meta
device (no weights read), so module names and fused MoE expert parameters are those PEFT sees;
they are kept under the cache (keyed by config.json and the transformers version) for the next
process.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from lora_conformance.patterns import PatternError, PatternMatcher
from lora_conformance.checkpoints import ADAPTER_CONFIG as CONFIG
from lora_conformance.checkpoints import ADAPTER_WEIGHTS as WEIGHTS
from lora_conformance.checkpoints import PEFT_PREFIX as PREFIX
from lora_conformance.checkpoints import (PEFT_DEFAULT_ALPHA, PEFT_DEFAULT_R, is_encoder, module_rank_alpha,
                                          pattern_value, read_adapter_config, scaling_rule, split_lora_key)
from lora_conformance.errors import AdapterFormatError

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
# Characters that would make a name a path, a URL part or SGLang's "<base>:<adapter>" ambiguous.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


@dataclass(frozen=True)
class BaseShapes:
    """What a base model offers LoRA: modules (name -> kind, weight shape) and 3-D parameters."""

    modules: dict  # name -> ("linear", (out, in)) | ("embedding", (vocab, hidden))
    params: dict  # every parameter name -> shape (3-D expert parameters included)
    num_layers: int
    others: tuple = ()  # every other module's name (containers, norms, ...): PEFT cannot wrap them


@dataclass
class ValidatedAdapter:
    path: Path
    config: dict
    tensors: dict  # name -> torch.Tensor (cpu)
    weights_file: Path
    weights_sha256: str  # of the weights file's bytes (engines key caches on it)
    module_params: dict  # module -> (rank, alpha) after rank_pattern / alpha_pattern (PEFT's matching)


def validate_name(name: Any) -> str:
    """Adapter names are identifiers: no separators, no whitespace, not PEFT's ``__base__``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name == "__base__" or name in (".", ".."):
        raise AdapterFormatError("<adapter name>", "name",
                                 f"{name!r} is not a valid adapter name (1-128 of A-Z a-z 0-9 _ . -, "
                                 "starting with a letter, digit or _; not __base__)")
    return name


# Base shapes can be kept between processes in a directory the caller names (the session's
# ``<cache>/shapes``): building them imports transformers' modelling code (about 1 s per process).


def _shapes_key(model_dir: str) -> Optional[str]:
    from lora_conformance.models import transformers_files_key

    return transformers_files_key(model_dir, ("config.json",), f"encoder={is_encoder(model_dir)}")


def _shapes_from_json(data: dict) -> BaseShapes:
    return BaseShapes({n: (k, tuple(shape)) for n, (k, shape) in data["modules"].items()},
                      {n: tuple(shape) for n, shape in data["params"].items()}, int(data["num_layers"]),
                      tuple(data["others"]))


@lru_cache(maxsize=8)
def _base_shapes(model_dir: str, stamp: float, cache_dir: Optional[Path]) -> BaseShapes:
    key = _shapes_key(model_dir) if cache_dir is not None else None
    path = cache_dir / f"{key}.json" if key else None
    if path is not None and path.exists():
        try:
            return _shapes_from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or from another layout: rebuilt and rewritten below
    shapes = _build_base_shapes(model_dir)
    if path is not None:
        from lora_conformance.fileio import write_json_atomic

        try:
            write_json_atomic(path, {"modules": shapes.modules, "params": shapes.params,
                                     "num_layers": shapes.num_layers, "others": list(shapes.others)})
        except OSError:
            pass  # a read-only cache only costs the rebuild
    return shapes


def _build_base_shapes(model_dir: str) -> BaseShapes:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = (AutoModel if is_encoder(model_dir) else AutoModelForCausalLM).from_config(cfg)
    modules, others = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            modules[name] = ("linear", (mod.out_features, mod.in_features))
        elif isinstance(mod, torch.nn.Embedding):
            modules[name] = ("embedding", (mod.num_embeddings, mod.embedding_dim))
        elif name:  # PEFT never targets the root
            others.append(name)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg.get_text_config(), "num_hidden_layers", 0))
    return BaseShapes(modules, params, layers, tuple(others))


def base_shapes(model_dir: Path, cache_dir: Optional[Path] = None) -> BaseShapes:
    cfg = Path(model_dir) / "config.json"
    return _base_shapes(str(Path(model_dir).resolve()), cfg.stat().st_mtime if cfg.exists() else 0.0,
                        None if cache_dir is None else Path(cache_dir))


def _targeted(targets, module: str, matcher: PatternMatcher) -> bool:
    """Whether ``target_modules`` (PEFT semantics) names ``module``; None targets everything given."""
    if targets is None:
        return True
    if isinstance(targets, str):
        return matcher.target_matches(targets, module)
    return "all-linear" in targets or any(module == t or module.endswith("." + t) for t in targets)


# ---- config ---------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_config(cfg: dict, f: Path, base: BaseShapes, matcher: Optional[PatternMatcher] = None) -> None:
    matcher = matcher or PatternMatcher()

    def bad(field, problem):
        raise AdapterFormatError(f, field, problem)

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        bad("peft_type", f"{cfg.get('peft_type')!r}; expected LORA")
    r = cfg.get("r", PEFT_DEFAULT_R)
    if not _is_int(r) or r < 1:
        bad("r", f"{r!r}; expected an integer >= 1")
    if not _is_number(cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)):
        bad("lora_alpha", f"{cfg.get('lora_alpha')!r}; expected a finite number")
    for key in ("use_rslora", "use_dora", "lora_bias"):
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], bool):
            bad(key, f"{cfg[key]!r}; expected true or false")
    if cfg.get("bias", "none") not in ("none", "all", "lora_only"):
        bad("bias", f"{cfg.get('bias')!r}; expected none, all or lora_only")
    for key, ok, what in (("rank_pattern", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
                          ("alpha_pattern", _is_number, "a finite number")):
        pat = cfg.get(key)
        if pat is None:
            continue
        if not isinstance(pat, dict):
            bad(key, f"expected an object of module pattern -> value, got {type(pat).__name__}")
        for k, v in pat.items():
            if not ok(v):
                bad(f"{key}.{k}", f"{v!r}; expected {what}")
            try:
                re.compile(k)
            except re.error as exc:
                bad(f"{key}.{k}", f"not a valid pattern ({exc})")
            try:  # every module name once: a pattern that backtracks without end is refused here, in bounded time
                for name in base.modules:
                    matcher.pattern_key({k: v}, name)
            except PatternError as exc:
                bad(f"{key}.{k}", str(exc))
    tm = cfg.get("target_modules")
    if isinstance(tm, str):
        _check_target_regex(tm, base, matcher, bad)
    elif tm is not None:
        if not isinstance(tm, list) or not all(isinstance(t, str) and t for t in tm):
            bad("target_modules", f"{tm!r}; expected a list of module names or a regex string")
        for t in tm:
            if t != "all-linear" and not any(n == t or n.endswith("." + t) for n in base.modules):
                bad("target_modules", f"{t!r} matches no module of the base model")
    tp = cfg.get("target_parameters")
    if tp is not None:
        if not isinstance(tp, list) or not all(isinstance(t, str) and t for t in tp):
            bad("target_parameters", f"{tp!r}; expected a list of parameter names")
        for t in tp:
            if not any(n == t or n.endswith("." + t) for n in base.params):
                bad("target_parameters", f"{t!r} matches no parameter of the base model")
    for key in ("modules_to_save",):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(t, str) for t in v)):
            bad(key, f"{v!r}; expected a list of module names")
    layers = cfg.get("layers_to_transform")
    if layers is not None:
        items = [layers] if _is_int(layers) else layers
        if not isinstance(items, list) or not all(_is_int(i) for i in items):
            bad("layers_to_transform", f"{layers!r}; expected an integer or a list of integers")
        out = [i for i in items if not 0 <= i < base.num_layers]
        if out:
            bad("layers_to_transform", f"{out} outside the base model's layers 0..{base.num_layers - 1}")


def _check_target_regex(tm: str, base: BaseShapes, matcher: PatternMatcher, bad) -> None:
    """PEFT: a string target_modules must match whole module names; a match on a module LoRA cannot
    wrap (a container, a norm) is PEFT's ValueError "Target module ... is not supported", and no
    match at all its "Target modules ... not found in the base model"."""
    try:
        matched = [n for n in base.modules if matcher.target_matches(tm, n)]
        unsupported = [n for n in base.others if matcher.target_matches(tm, n)]
    except PatternError as exc:
        bad("target_modules", f"{tm!r}: {exc}")
    if unsupported:
        bad("target_modules", f"the regex {tm!r} matches modules LoRA cannot wrap ({', '.join(unsupported[:3])}"
                              f"{', ...' if len(unsupported) > 3 else ''}); PEFT refuses it too: a string "
                              "target_modules must match whole names of Linear or Embedding modules only")
    if not matched:
        bad("target_modules", f"the regex {tm!r} matches no module name of the base model as a whole (PEFT "
                              "matches a string target_modules against the full name, e.g. '.*\\.q_proj')")


# ---- weights --------------------------------------------------------------------------------


def weights_file(path: Path) -> Path:
    for name in WEIGHTS:
        f = path / name
        if f.is_file():
            return f
    raise AdapterFormatError(path, "weights", f"neither {' nor '.join(WEIGHTS)} found")


def read_weights(f: Path, size_limit: Optional[int] = None) -> dict:
    """The tensors of ``f`` (safetensors memory-mapped; a pickle only under ``size_limit`` bytes)."""
    import torch

    from lora_conformance.adapters.weights import check_pickle_size

    try:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(f))
        else:
            check_pickle_size(f, size_limit)
            tensors = torch.load(str(f), map_location="cpu", weights_only=True)
    except AdapterFormatError:
        raise
    except Exception as exc:  # safetensors/pickle raise many kinds; all mean "not a readable file"
        raise AdapterFormatError(f, "file", f"unreadable or truncated ({type(exc).__name__}: {exc})") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise AdapterFormatError(f, "file", "expected a mapping of tensor names to tensors")
    return tensors


def _expert_param(mod: str, A, B, cfg: dict, base: BaseShapes) -> Optional[tuple[str, tuple]]:
    """The fused 3-D (E, out, in) parameter of ``mod`` these tensors fit (order of nesting unknown)."""
    for t in cfg.get("target_parameters") or ():
        cand = f"{mod}.{t.rpartition('.')[2]}"
        shape = base.params.get(cand)
        if shape is None or len(shape) != 3 or not (cand == t or cand.endswith("." + t)):
            continue
        E, out_f, in_f = shape
        if A.dim() == 2 and B.dim() == 2 and A.shape[1] == in_f and B.shape[0] == out_f and A.shape[0] % E == 0:
            return cand, shape
    return None


def check_tensors(tensors: dict, f: Path, cfg: dict, base: BaseShapes, max_rank: Optional[int],
                  matcher: Optional[PatternMatcher] = None) -> dict:
    """Names, dtypes, shapes and ranks (no values: ``tensors`` may be meta tensors from the
    header). Returns the LoRA pairs: (module, nesting depth) -> {"A"|"B": (key, tensor)}, and
    fills nothing else."""
    matcher = matcher or PatternMatcher()

    def bad(field, problem):
        raise AdapterFormatError(f, field, problem)

    pairs: dict[tuple[str, int], dict] = {}
    for key, t in tensors.items():
        if not key.startswith(PREFIX):
            bad(key, f"tensor name does not start with {PREFIX!r} (not a saved PEFT adapter)")
        if str(t.dtype).replace("torch.", "") not in FLOAT_DTYPES:
            bad(key, f"dtype {t.dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
        lk = split_lora_key(key)
        if lk.factor:
            pairs.setdefault((lk.module, lk.depth), {})[lk.factor] = (key, t)
        else:
            _check_other(key, lk.module, t, base, bad)
    if not pairs:
        bad("tensors", "no lora_A / lora_B tensors")
    r0 = cfg.get("r", PEFT_DEFAULT_R)
    rank_pattern = cfg.get("rank_pattern") or {}
    targets = cfg.get("target_modules")
    for (mod, depth), ts in sorted(pairs.items()):
        if "A" not in ts or "B" not in ts:
            have = next(iter(ts.values()))[0]
            bad(have, f"module {mod!r} has lora_{'A' if 'B' in ts else 'B'} missing")
        (ka, A), (kb, B) = ts["A"], ts["B"]
        if A.dim() != 2 or B.dim() != 2:
            bad(ka if A.dim() != 2 else kb, f"expected a 2-D tensor, got shape {tuple((A if A.dim() != 2 else B).shape)}")
        hf_mod = mod[len("bert."):] if mod.startswith("bert.") and mod not in base.modules else mod
        expert = None if hf_mod in base.modules else _expert_param(hf_mod, A, B, cfg, base)
        if expert is not None:
            E, out_f, in_f = expert[1]
            rank, want_a, want_b = A.shape[0] // E, (A.shape[0], in_f), (out_f, A.shape[0])
        elif hf_mod in base.modules:
            kind, (d0, d1) = base.modules[hf_mod]
            try:
                targeted = _targeted(targets, hf_mod, matcher)
            except PatternError as exc:
                bad("target_modules", f"{targets!r}: {exc}")
            if not targeted:
                how = "matched (as a whole name) by the target_modules regex" if isinstance(targets, str) else \
                    "named by target_modules"
                bad(ka, f"module {hf_mod!r} is not {how} {targets!r}, so PEFT would ignore its tensors")
            rank = A.shape[0]
            if kind == "embedding":  # lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)
                want_a, want_b = (rank, d0), (d1, rank)
            else:  # lora_A (r, in), lora_B (out, r)
                want_a, want_b = (rank, d1), (d0, rank)
        else:
            bad(ka, f"module {hf_mod!r} does not exist in the base model (or fits none of its expert parameters)")
        if tuple(A.shape) != want_a:
            bad(ka, f"shape {tuple(A.shape)} does not fit the base model; expected {want_a}")
        if tuple(B.shape) != want_b:
            bad(kb, f"shape {tuple(B.shape)} does not fit the base model; expected {want_b}")
        try:
            pkey = matcher.pattern_key(rank_pattern, hf_mod)
        except PatternError as exc:
            bad("rank_pattern", str(exc))
        field = "rank_pattern" if pkey is not None else "r"
        want_r = int(r0 if pkey is None else rank_pattern[pkey])
        if expert is None and rank != want_r:
            bad(field, f"{want_r} in {f.parent / CONFIG}, but {ka} has rank {rank}")
        if max_rank is not None and rank > max_rank:
            bad(field, f"rank {rank} of {hf_mod} ({field} in {CONFIG}) exceeds this engine's max_rank={max_rank}")
    return pairs


def module_params(pairs: dict, cfg: dict, f: Path, matcher: PatternMatcher) -> dict:
    """module -> (rank, alpha) as PEFT resolves them (rank_pattern / alpha_pattern, first key wins)."""
    out = {}
    for mod, _ in pairs:
        hf_mod = _hf_name(mod)
        try:
            out[hf_mod] = module_rank_alpha(cfg, hf_mod, matcher)
        except PatternError as exc:
            raise AdapterFormatError(f.parent / CONFIG, "alpha_pattern", str(exc)) from None
    return out


def _hf_name(mod: str) -> str:
    return mod[len("bert."):] if mod.startswith("bert.") else mod


def check_values(tensors: dict, pairs: dict, params: dict, cfg: dict, f: Path, dtype: str) -> None:
    """Every value finite in the compute dtype ``dtype``, after conversion, and so the scaling
    and ``lora_B * scaling`` (engines that fold the scaling into B store that)."""
    import torch

    cd = getattr(torch, dtype)
    cfg_file = f.parent / CONFIG
    for key, t in tensors.items():
        if not t.numel():
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            raise AdapterFormatError(f, key, f"{int((~finite).sum())} non-finite value(s) (NaN or Inf)")
        conv = torch.isfinite(t.to(cd))
        if not bool(conv.all()):
            big = float(t.double().abs().max())
            raise AdapterFormatError(f, key, f"{int((~conv).sum())} value(s) overflow to Inf when converted from "
                                             f"{str(t.dtype).replace('torch.', '')} to the engine's {dtype} "
                                             f"(largest magnitude {big:.3g}); expected values finite in {dtype}")
    rs = bool(cfg.get("use_rslora", False))
    for (mod, _), ts in pairs.items():
        hf_mod = _hf_name(mod)
        r, alpha = params[hf_mod]
        scale = scaling_rule(r, alpha, rs)
        field = "alpha_pattern" if alpha != module_rank_alpha(cfg)[1] else "lora_alpha"
        if not math.isfinite(float(torch.tensor(scale, dtype=torch.float64).to(cd))):
            raise AdapterFormatError(cfg_file, field, f"{alpha!r} gives {hf_mod} the scaling {scale:.3g} "
                                                      f"(alpha/{'sqrt(r)' if rs else 'r'}), not finite in the "
                                                      f"engine's {dtype}; expected a scaling finite in {dtype}")
        kb, B = ts["B"]
        folded = torch.isfinite((B.double() * scale).to(cd))
        if not bool(folded.all()):
            raise AdapterFormatError(f, kb, f"lora_B x scaling ({scale:.3g}) overflows the engine's {dtype} "
                                            f"({int((~folded).sum())} value(s)); expected lora_B * lora_alpha / r "
                                            f"finite in {dtype}")


def _check_other(key: str, mod: str, t, base: BaseShapes, bad) -> None:
    """Non-LoRA tensors: DoRA magnitudes and LoRA biases (out,), full copies (modules_to_save,
    embedding base_layer copies) shaped like the base parameter they replace."""
    if mod.endswith(".lora_magnitude_vector") or mod.endswith(".lora_B.bias"):
        owner = mod.rsplit(".", 2 if mod.endswith(".lora_B.bias") else 1)[0]
        while owner.endswith(".base_layer"):
            owner = owner[: -len(".base_layer")]
        spec = base.modules.get(owner)
        if spec is None:
            bad(key, f"module {owner!r} does not exist in the base model")
        if tuple(t.shape) != (spec[1][0],):
            bad(key, f"shape {tuple(t.shape)}; expected ({spec[1][0]},)")
        return
    param = re.sub(r"\.(base_layer|modules_to_save\.[^.]+|original_module)\.", ".", mod)
    shape = base.params.get(param)
    if shape is None:
        bad(key, "unexpected tensor: neither a LoRA tensor nor a copy of a base model parameter")
    if tuple(t.shape) != shape:
        bad(key, f"shape {tuple(t.shape)} does not match the base parameter {param} {shape}")


def _pickle_limit(base: BaseShapes) -> int:
    """No adapter of this base model holds more than two float64 copies of every parameter."""
    return 16 * sum(math.prod(shape) for shape in base.params.values()) + (1 << 20)


def validate_adapter(path: Path, model_dir: Path, max_rank: Optional[int] = None,
                     dtype: Optional[str] = None) -> ValidatedAdapter:
    """Check ``path`` against the base model at ``model_dir`` and an engine computing in ``dtype``
    (default float32); return what was read. A safetensors file's header is checked (names,
    dtypes, shapes, ranks) before its data is read."""
    from lora_conformance.adapters.weights import file_sha256, meta_tensors, read_header

    path = Path(path)
    base = base_shapes(Path(model_dir))
    cfg = read_adapter_config(path)
    matcher = PatternMatcher()
    check_config(cfg, path / CONFIG, base, matcher)
    f = weights_file(path)
    if f.suffix == ".safetensors":
        check_tensors(meta_tensors(read_header(f)), f, cfg, base, max_rank, matcher)
    tensors = read_weights(f, _pickle_limit(base))
    pairs = check_tensors(tensors, f, cfg, base, max_rank, matcher)
    params = module_params(pairs, cfg, f, matcher)
    check_values(tensors, pairs, params, cfg, f, _compute_dtype(dtype))
    return ValidatedAdapter(path, cfg, tensors, f, file_sha256(f), params)


def _compute_dtype(dtype: Optional[str]) -> str:
    d = str(dtype or "float32").replace("torch.", "")
    return d if d in ("float32", "float16", "bfloat16", "float64") else "float32"
