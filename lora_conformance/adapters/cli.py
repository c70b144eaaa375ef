"""``lora-conformance synth model|adapter``: write synthetic base models and known-weight adapters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lora_conformance.adapters.spec import BIAS_VALUES, TARGET_SETS
    from lora_conformance.models import SYNTHETIC_KINDS

    sub = parser.add_subparsers(dest="synth_what", required=True, metavar="WHAT")
    m = sub.add_parser("model", help="build a synthetic base model directory")
    m.add_argument("kind", help=f"one of: {', '.join(SYNTHETIC_KINDS)}")
    m.add_argument("--out", required=True, type=Path)
    m.add_argument("--seed", default="0")

    a = sub.add_parser("adapter", help="synthesize a PEFT adapter directory with seeded weights")
    a.add_argument("--base", required=True, help="a model directory or synthetic:<kind>")
    a.add_argument("--out", required=True, type=Path)
    a.add_argument("--targets", default="qv", help=f"a set ({', '.join(TARGET_SETS)}) or comma-separated module names")
    a.add_argument("--rank", default="8")
    a.add_argument("--alpha", default="16")
    a.add_argument("--rslora", action="store_true")
    a.add_argument("--rank-pattern", nargs="*", default=[], metavar="MODULE=R")
    a.add_argument("--alpha-pattern", nargs="*", default=[], metavar="MODULE=A")
    a.add_argument("--layers", default=None, help="comma-separated layer indices")
    a.add_argument("--dora", action="store_true")
    a.add_argument("--modules-to-save", nargs="*", default=None)
    a.add_argument("--bias", default="none", help=f"one of: {', '.join(BIAS_VALUES)}")
    a.add_argument("--zero", action="store_true", help="B = 0 (a no-op adapter)")
    a.add_argument("--seed", default="0")
    a.add_argument("--b-std", default=None)
    a.add_argument("--cache-dir", type=Path, default=None, help="where synthetic base models are cached")


class UsageError(ValueError):
    pass


def _number(field: str, value: str, kind=int, expected: str = "an integer"):
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise UsageError(f"{field}: expected {expected}, got {value!r}") from None


def _pattern(field: str, items: list[str], kind) -> dict:
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{field}: expected MODULE=VALUE pairs, got {item!r}")
        out[key] = _number(field, val, kind, "MODULE=NUMBER")
    return out


def _spec(args):
    from lora_conformance.adapters.spec import TARGET_SETS, AdapterSpec

    targets = args.targets
    if targets not in TARGET_SETS:
        targets = tuple(t for t in targets.split(",") if t)
        if not targets:
            raise UsageError(f"--targets: expected a set ({', '.join(TARGET_SETS)}) or module names")
    layers = None
    if args.layers is not None:
        layers = tuple(_number("--layers", x, int, "comma-separated integers") for x in args.layers.split(","))
    try:
        return AdapterSpec(
            targets=targets,
            rank=_number("--rank", args.rank),
            alpha=_number("--alpha", args.alpha, float, "a number"),
            use_rslora=args.rslora,
            rank_pattern=_pattern("--rank-pattern", args.rank_pattern, int),
            alpha_pattern=_pattern("--alpha-pattern", args.alpha_pattern, float),
            layers_to_transform=layers,
            use_dora=args.dora,
            modules_to_save=tuple(args.modules_to_save) if args.modules_to_save else None,
            bias=args.bias,
            zero=args.zero,
            seed=_number("--seed", args.seed),
            b_std=None if args.b_std is None else _number("--b-std", args.b_std, float, "a number >= 0"),
        )
    except UsageError:
        raise
    except ValueError as exc:  # AdapterSpec.validate names the field (rank_pattern -> --rank-pattern)
        field, _, rest = str(exc).partition(":")
        raise UsageError(f"--{field.replace('_', '-')}:{rest}") from None


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a directory; expected a new or existing directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--out: {parent} is a file, so {out} cannot be created")
            break


def _check_layers(spec, base: Path) -> None:
    """--layers must name layers of the base model (PEFT silently skips the others)."""
    from lora_conformance.checkpoints import read_model_config

    if spec.layers_to_transform is None:
        return
    cfg = read_model_config(base)
    n = int(cfg.get("num_hidden_layers") or 0)
    outside = [i for i in spec.layers_to_transform if not 0 <= i < n]
    if outside:
        raise UsageError(f"--layers: {', '.join(map(str, outside))} outside the base model's layers 0..{n - 1}")


def run(args) -> int:
    try:
        if args.synth_what == "model":
            from lora_conformance.models import SYNTHETIC_KINDS, build_synthetic

            if args.kind not in SYNTHETIC_KINDS:
                raise UsageError(f"kind: expected one of {', '.join(SYNTHETIC_KINDS)}, got {args.kind!r}")
            _check_out(args.out)
            out = build_synthetic(args.kind, args.out, _number("--seed", args.seed))
        else:
            from lora_conformance.adapters.synth import synthesize_adapter
            from lora_conformance.models import resolve_base_model
            from lora_conformance.settings import default_cache_dir

            spec = _spec(args)
            _check_out(args.out)
            try:
                base = resolve_base_model(args.base, args.cache_dir or default_cache_dir())
            except ValueError as exc:
                raise UsageError(f"--base: {exc}") from None
            _check_layers(spec, base)
            try:
                out = synthesize_adapter(base, spec, args.out)
            except ValueError as exc:  # PEFT: a target that the base model does not have
                raise UsageError(f"--targets: {str(exc).splitlines()[0]}") from None
            except OSError as exc:
                raise UsageError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
    except UsageError as exc:
        print(f"lora-conformance synth: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
