"""Time the validator on the bad adapters of the reliability probes: pathological pattern keys,
a sparse 4 GiB weights file, values that overflow the compute dtype, regex target_modules.

    python bench/probe_bad_adapters.py

Each line: seconds, accepted or the refusal. The first validation of a process builds the base
model's module shapes (imports transformers); a warm-up load is timed separately.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from lora_conformance.adapters import AdapterSpec, synthesize_cached
from lora_conformance.adapters.malformed import header_overruns_file, make_malformed
from lora_conformance.adapters.validate import validate_adapter
from lora_conformance.engines.base import AdapterFormatError
from lora_conformance.models import resolve_base_model
from lora_conformance.settings import default_cache_dir

KEYS = ("(.*.*)*z", ".*.*.*.*.*.*.*.*.*.*.*.*z", "(.*){1,300}[bc]")
KINDS = ("float64_overflows_compute_dtype", "alpha_overflows_compute_dtype", "target_regex_matches_nothing",
         "target_regex_matches_containers", "target_regex_leaves_tensors_untargeted", "pattern_key_backtracks")


def main() -> None:
    cache = default_cache_dir()
    model = resolve_base_model("synthetic:llama", cache / "models")
    good = synthesize_cached(model, AdapterSpec(seed=4), cache / "adapters")

    def timed(d: Path, dtype=None) -> str:
        t = time.monotonic()
        try:
            validate_adapter(d, model, 64, dtype)
            result = "accepted"
        except AdapterFormatError as exc:
            result = "refused: " + str(exc).split(": ", 1)[1][:120]
        return f"{time.monotonic() - t:7.3f} s  {result}"

    print(f"warm-up (imports, base shapes)  {timed(good)}")
    with tempfile.TemporaryDirectory() as tmp:
        for field in ("rank_pattern", "alpha_pattern"):
            for key in KEYS:
                d = Path(tmp) / "p"
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(good, d)
                cfg = json.loads((d / "adapter_config.json").read_text())
                cfg[field] = {key: 4}
                (d / "adapter_config.json").write_text(json.dumps(cfg))
                print(f"{field} {key!r:32} {timed(d)}")
        huge = header_overruns_file(good, Path(tmp) / "huge", 64)
        size = (huge / "adapter_model.safetensors").stat().st_size
        print(f"{size}-byte weights file (sparse)  {timed(huge)}")
        for kind in KINDS:
            print(f"{kind:40} {timed(make_malformed(kind, good, Path(tmp) / kind, 64))}")
        d = make_malformed("config_rank_mismatch", good, Path(tmp) / "fp16", 64)  # a copy to edit
        shutil.copy(good / "adapter_config.json", d / "adapter_config.json")
        from safetensors.torch import load_file, save_file

        ts = load_file(str(d / "adapter_model.safetensors"))
        k = next(k for k in sorted(ts) if k.endswith("lora_B.weight"))
        ts[k] = ts[k].clone()
        ts[k].view(-1)[0] = 1e5
        save_file(ts, str(d / "adapter_model.safetensors"))
        print(f"{'lora_B 1e5, float32 engine':40} {timed(d, 'float32')}")
        print(f"{'lora_B 1e5, float16 engine':40} {timed(d, 'float16')}")


if __name__ == "__main__":
    main()
