"""What OpenVINO GenAI does with each malformed adapter of the bad-input suite, with no validator.

    python ci/repro/openvino_malformed_adapters.py [KIND ...]

Each kind runs in a process of its own (a crash must not hide the next kind): the ``openvino``
engine (engine arg validate_adapters off, its default) loads the adapter, then serves one request
with it. One line per kind: ``refused`` (a typed EngineError, its text), ``accepted`` (with whether
the served logprobs are finite), or ``crashed`` (the process's exit status or signal).
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path


def one(kind: str, work: Path) -> None:
    from lora_conformance.adapters import AdapterSpec, synthesize_cached
    from lora_conformance.adapters.malformed import make_malformed
    from lora_conformance.engines import EngineError, create_engine
    from lora_conformance.models import resolve_base_model
    from lora_conformance.settings import default_cache_dir
    from lora_conformance.types import GenerationRequest

    cache = default_cache_dir()
    model = resolve_base_model("synthetic:llama", cache / "models")
    good = synthesize_cached(model, AdapterSpec(seed=4), cache / "adapters")
    bad = make_malformed(kind, good, work / kind, 64)
    engine = create_engine("openvino", model, "cpu", "float32", {})
    try:
        try:
            engine.load_adapter("bad", bad)
        except EngineError as exc:
            print(f"{kind:42} refused: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return
        out = engine.generate([GenerationRequest(prompt="once upon a time", adapter="bad", max_new_tokens=4)])
        lps = [lp for step in out[0].logprobs for lp in dict(step).values()]
        print(f"{kind:42} accepted: served tokens {list(out[0].token_ids)}, logprobs finite: "
              f"{all(math.isfinite(x) for x in lps)}", flush=True)
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    from lora_conformance.adapters.malformed import MALFORMED

    if argv and argv[0] == "--one":
        one(argv[1], Path(argv[2]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for kind in argv or list(MALFORMED):
            proc = subprocess.run([sys.executable, __file__, "--one", kind, tmp], capture_output=True, text=True,
                                  timeout=600)
            lines = [l for l in proc.stdout.splitlines() if l.startswith(kind)]
            if proc.returncode:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:160]
                print(f"{kind:42} crashed: exit status {proc.returncode}: {tail}", flush=True)
            else:
                print(lines[-1] if lines else f"{kind:42} no verdict: {proc.stderr[-200:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
