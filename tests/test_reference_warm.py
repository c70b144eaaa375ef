"""A warm reference cache hit is cheap: no forward pass, and no PEFT import (about 2 s of cpu per process)."""

import subprocess
import sys

from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.types import GenerationRequest

LOOKUP = """
import sys
from pathlib import Path
from lora_conformance.reference import ReferenceCache, ReferenceRunner
from lora_conformance.types import GenerationRequest
runner = ReferenceRunner(Path(sys.argv[1]), cache=ReferenceCache(Path(sys.argv[2])))
reqs = [GenerationRequest("once upon a time", adapter=a, max_new_tokens=2) for a in (None, "A")]
out = runner.generate(reqs, {"A": Path(sys.argv[3])})
print("RESULT", runner.forward_passes, runner.cache.hits, "peft" in sys.modules, [o.token_ids for o in out])
"""


def test_warm_lookup_in_a_new_process_imports_no_peft(llama, cache, tmp_path):
    adapter = synthesize_cached(llama, AdapterSpec(seed=1), cache)
    reqs = [GenerationRequest("once upon a time", adapter=a, max_new_tokens=2) for a in (None, "A")]
    expected = ReferenceRunner(llama, cache=ReferenceCache(tmp_path)).generate(reqs, {"A": adapter})
    out = subprocess.run([sys.executable, "-c", LOOKUP, str(llama), str(tmp_path), str(adapter)],
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out.stdout[-1000:] + out.stderr[-2000:]
    assert line == f"RESULT 0 2 False {[e.token_ids for e in expected]}", (
        f"got {line!r}; expected 0 forward passes, 2 cache hits, peft not imported, the same tokens")
