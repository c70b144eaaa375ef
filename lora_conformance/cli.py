"""``lora-conformance`` command line: one subcommand per concern, each in its own module.

Each module named in SUBCOMMANDS exposes ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "certify": ("lora_conformance.report.certify", "run the conformance suites and write a certification report"),
    "synth": ("lora_conformance.adapters.cli", "synthesize offline base models and known-weight adapters"),
    "ci": ("lora_conformance.ci.cli", "CI tooling: list registrations, print a GitHub Actions matrix"),
    "report": ("lora_conformance.report.cli", "merge and re-render certification reports"),
    "engines": ("lora_conformance.engines.cli", "list the engines and whether each can run here; describe one's "
                "arguments and capabilities"),
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (none for top-level help)."""
    parser = argparse.ArgumentParser(prog="lora-conformance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
