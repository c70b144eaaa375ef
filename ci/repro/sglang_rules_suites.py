"""Run suite files with ``--engine=sglang`` over the SGLang stand-in whose outputs the built-in
engine computes (tests/_sglang_standin.py, compute=True): what SGLang's own bookkeeping (slots
counting the base, the pin rule, eviction past max_loaded_loras, the distinct-paths limit) does
to the suites, without SGLang. Not a certification of SGLang: its kernels never run.

    python ci/repro/sglang_rules_suites.py [--version 0.5.23] suites/test_combinations.py ...
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.5.23", help="SGLang release whose rules the stand-in follows")
    parser.add_argument("files", nargs="*", default=[str(ROOT / "suites")])
    args, pytest_args = parser.parse_known_args()
    import _sglang_standin as standin
    import pytest

    sys.modules["sglang"] = standin.module(args.version, compute=True)
    return pytest.main([*args.files, "--device=cpu", "--dtype=float32", "--engine=sglang", "-p", "no:cacheprovider",
                        "-q", "-rfEs", "--tb=line", *pytest_args])


if __name__ == "__main__":
    sys.exit(main())
