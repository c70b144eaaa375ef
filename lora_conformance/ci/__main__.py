"""``python -m lora_conformance.ci list|matrix``: the ``ci`` subcommand without the other subcommands' imports."""

import sys

from lora_conformance.ci.cli import main

sys.exit(main())
