"""``lora-conformance`` command line: one subcommand per concern, each in its own module.

Each module named in SUBCOMMANDS exposes ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``--help`` and ``--version`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

SUBCOMMANDS = {
    "certify": ("lora_conformance.launch", "run the conformance suites and write a certification report"),
    "synth": ("lora_conformance.adapters.cli", "synthesize offline base models and known-weight adapters"),
    "ci": ("lora_conformance.ci.cli", "CI tooling: list registrations, print a GitHub Actions matrix"),
    "report": ("lora_conformance.report.cli", "verify, render, merge and sign certification reports"),
    "engines": ("lora_conformance.engines.cli", "list the engines and whether each can run here; describe one"),
    "scoreboard": ("lora_conformance.scoreboard.cli", "build the static scoreboard site from a directory of reports"),
    "submit": ("lora_conformance.submit", "check a signed certified-mode report, write a pull request"),
}

DESCRIPTION = "Certify LoRA inference engines on any accelerator against the HF transformers + PEFT reference."

# Shown under each subcommand's --help (a subcommand missing here shows none).
EXAMPLES = {
    "certify": """\
  lora-conformance certify --device cpu                      # the built-in engine, report in ./lora-report
  lora-conformance certify --device cuda --engine vllm --report out/vllm-cuda
  lora-conformance certify --device xpu --dtype bfloat16 --engine-arg max_loras_per_batch=2
  lora-conformance certify --device cpu -- -k mixed_batch    # pytest arguments after --""",
    "synth": """\
  lora-conformance synth model llama --out models/llama
  lora-conformance synth adapter --base models/llama --targets qv --rank 8 --seed 1 --out adapters/a""",
    "ci": """\
  lora-conformance ci list --hw xpu
  lora-conformance ci matrix --hw cuda --suite per-commit --shards 4""",
    "report": """\
  lora-conformance report verify lora-report                 # re-verify a stored report's verdict
  lora-conformance report render lora-report -o lora-report
  lora-conformance report merge cpu-report cuda-report -o merged
  lora-conformance report sign lora-report/report.json --key vendor.key""",
    "engines": """\
  lora-conformance engines                                   # every engine, and whether it can run here
  lora-conformance engines describe vllm                     # its arguments and capabilities
  lora-conformance engines describe builtin --device cuda --engine-arg prefix_cache=0""",
    "scoreboard": """\
  lora-conformance scoreboard reports/ -o site/              # keys from reports/keys, revocations from reports/revoked.toml
  lora-conformance scoreboard reports/ -o site/ --keys keys/ --revoked revoked.toml""",
    "submit": """\
  lora-conformance submit lora-report/report.json --key vendor.pub -o submission/""",
}


def version_line() -> str:
    """``lora-conformance X.Y.Z from PATH (python 3.N)``: which installation runs (pip's format)."""
    from pathlib import Path

    import lora_conformance

    where = Path(lora_conformance.__file__).resolve().parent
    return f"lora-conformance {lora_conformance.__version__} from {where} (python {sys.version_info[0]}.{sys.version_info[1]})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser(command: Optional[str] = None, prog: str = "lora-conformance") -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (none for top-level help)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(e.splitlines()[0] for e in EXAMPLES.values())
        + f"\n\n'{prog} COMMAND --help' describes a command.")
    parser.add_argument("--version", action=_Version, help="print the version and where it is installed, then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        example = EXAMPLES.get(name)
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"examples:\n{example}" if example else None)
        p.set_defaults(_module=module)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "lora-conformance") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None, prog).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
