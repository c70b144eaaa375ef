"""``lora-conformance engines``: the registered engines, whether each can run here, and what it takes.

``lora-conformance engines`` lists every engine (ours and those registered through the
``lora_conformance.engines`` entry-point group) with its availability: whether the modules it
needs can be imported, found with ``importlib.util.find_spec`` (vLLM, SGLang, OpenVINO are not
imported). ``lora-conformance engines describe NAME`` prints its arguments (name, type, default,
meaning), how it takes the standard arguments the suites use, and its declared capabilities.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from lora_conformance.engines.args import (
    STANDARD_ARGS,
    EngineArgError,
    arg_specs,
    install_hint,
    missing_modules,
)
from lora_conformance.engines.base import EngineError
from lora_conformance.engines.registry import UnknownEngineError, available_engines, engine_class


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="engines_action", metavar="ACTION")
    sub.add_parser("list", help="every registered engine and whether it can run here (the default)")
    d = sub.add_parser("describe", help="an engine's arguments (name, type, default, meaning) and capabilities")
    d.add_argument("name", help="a registered engine name, or module:Class")
    d.add_argument("--device", default="cpu", help="the device the capabilities are given for (default: cpu)")
    d.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine argument the capabilities are given for (repeatable)")


def _summary(cls: type) -> str:
    doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()
    line = doc[0].replace("``", "").rstrip(".") if doc else ""
    return line.split(": ", 1)[1] if ": " in line else line


def availability(cls: type) -> tuple[bool, str]:
    missing = missing_modules(cls)
    if missing:
        return False, f"needs {', '.join(missing)}: {install_hint(cls)}"
    return True, ""


def list_engines(out=sys.stdout) -> int:
    rows = []
    for name, target in sorted(available_engines().items()):
        try:
            cls = engine_class(name)
        except Exception as exc:  # a third-party entry point that does not import: say so, list the rest
            rows.append((name, "no", f"{target} cannot be imported: {type(exc).__name__}: {exc}"))
            continue
        ok, why = availability(cls)
        rows.append((name, "yes" if ok else "no", _summary(cls) + ("" if ok else f" ({why})")))
    width = max(len(r[0]) for r in rows)
    print(f"{'ENGINE':{width}}  AVAILABLE  DESCRIPTION", file=out)
    for name, ok, text in rows:
        print(f"{name:{width}}  {ok:9}  {text}", file=out)
    print("\n`lora-conformance engines describe NAME` lists an engine's arguments and capabilities.", file=out)
    return 0


def _table(rows: list[tuple[str, ...]], out) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  " + "  ".join(f"{c:{w}}" for c, w in zip(r, widths)) + "  " + r[-1], file=out)


def _show_default(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value) if str(value) != "" else "''"


def describe(name: str, device: str = "cpu", raw_args: Optional[dict] = None, out=sys.stdout) -> int:
    cls = engine_class(name)
    ok, why = availability(cls)
    print(f"engine {name} ({cls.__module__}:{cls.__qualname__}): {_summary(cls)}", file=out)
    print(f"available here: {'yes' if ok else 'no, ' + why}", file=out)
    if cls.Args is None:
        print("\narguments: not declared (the engine checks its arguments itself when it starts)", file=out)
        return 0
    specs = arg_specs(cls.Args)
    own = {s.name for s in specs}
    mappings = cls.standard_args or {}
    rows = [("NAME", "TYPE", "HOW THIS ENGINE TAKES IT")]
    for key, spec in STANDARD_ARGS.items():
        if key in mappings:
            how = getattr(mappings[key], "text", "") or "translated to the engine's own arguments"
        elif key in own:
            how = "as named (below)"
        else:
            how = "not taken (an error)"
        rows.append((key, spec.type_name, how))
    print("\nstandard arguments (the suites ask for engine configurations in these words):", file=out)
    _table(rows, out)
    print("\nengine arguments (--engine-arg KEY=VALUE; '-': computed by the engine, see meaning):", file=out)
    rows = [("NAME", "TYPE", "DEFAULT", "MEANING")]
    for s in specs:
        choices = f" ({', '.join(str(c) for c in s.choices)})" if s.choices else ""
        rows.append((s.name, s.type_name, _show_default(s.default), s.help + choices))
    _table(rows, out)
    cfg = cls.parse_args(raw_args or {}, "command line")
    shown = ", ".join(f"{k}={v}" for k, v in (raw_args or {}).items()) or "default arguments"
    caps = cls.declared_capabilities(cfg, None, device)
    limits = cls.declared_limits(cfg, None, device)
    print(f"\ncapabilities ({shown}, a decoder base model, device {device}):", file=out)
    if caps is None:
        print("  known only once the engine starts", file=out)
    else:
        print("  " + (", ".join(sorted(c.value for c in caps)) or "none"), file=out)
    if limits is not None:
        print("limits: " + ", ".join(f"{k}={v}" for k, v in vars(limits).items() if v is not None), file=out)
    return 0


def run(args) -> int:
    try:
        if getattr(args, "engines_action", None) == "describe":
            from lora_conformance.engines.args import engine_arg_pairs

            return describe(args.name, args.device, engine_arg_pairs(args.engine_arg))
        return list_engines()
    except (UnknownEngineError, EngineArgError, EngineError, ValueError) as exc:
        print(f"lora-conformance engines: error: {exc}", file=sys.stderr)
        return 2
