"""``python -m lora_conformance.report merge|render``: the ``report`` subcommand, standard library only."""

import argparse
import sys

from lora_conformance.report.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m lora_conformance.report", description=__doc__.splitlines()[0])
add_arguments(parser)
sys.exit(run(parser.parse_args()))
