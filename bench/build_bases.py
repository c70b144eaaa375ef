"""Build a certification profile's synthetic bases into a cache, in parallel, before the runs that
share them (a device session's certification, bench/power_profile.sh's null runs):

    python bench/build_bases.py full /tmp/lc-full      # synthetic:qwen2.5-1.5b and synthetic:moe-64e

Each base is built once per recipe (``models.resolve_base_model``: cached under CACHE/models); the
full profile's two take about 90 s on 16 cores. synthetic:qwen2.5-1.5b alone: 95 s on 2 cores, 16.5 GB
resident at most (each layer is kept in float32 once final; 25 GB before). Prints each base's path and
seconds.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from lora_conformance.models import profiles, resolve_base_model

    try:
        profile, cache = profiles.get(argv[0]), Path(argv[1])
    except ValueError as exc:
        print(f"build_bases.py: {exc}", file=sys.stderr)
        return 2
    specs = sorted(set(profile.models.values()))
    start = time.time()
    with ProcessPoolExecutor(len(specs)) as pool:
        for spec, path in zip(specs, pool.map(resolve_base_model, specs, [cache / "models"] * len(specs))):
            print(f"base {spec}: {path} ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
