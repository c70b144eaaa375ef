"""``python -m lora_conformance``: the ``lora-conformance`` command."""

import sys

from lora_conformance.cli import main

sys.exit(main(prog="python -m lora_conformance"))
