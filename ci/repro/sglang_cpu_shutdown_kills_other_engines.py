"""SGLang's Engine.shutdown() ends every child process of the host process, other engines' too (cpu).

    /work/venv-sglang/bin/python ci/repro/sglang_cpu_shutdown_kills_other_engines.py

Two offline engines (sglang.Engine) of SGLang 0.5.15.post1 in one process. SGLang's own shutdown() of the
first runs kill_process_tree(os.getpid(), include_parent=False) (srt/entrypoints/engine.py:925), which
SIGKILLs the second engine's scheduler and detokenizer as well: the second engine's watchdog reports
"Subprocess scheduler_0 ... crashed with exit code -9" and its next call fails. The plugin's close()
(SGLangEngine._end_own_processes) ends only its own engine's processes; the second engine then serves.
Seen on a 2-core cpu machine: with shutdown() both of the second engine's processes exit -9;
with the plugin's close() they keep running and the second engine answers.

Before the plugin closed engines this way, this was behind every "scheduler died during initialization",
"its Process-N, Process-M process died (SIGQUIT)" and "closed after an engine failure" of the offline
certifications: the suites keep several engines per worker and close retired ones on a thread.
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from lora_conformance.engines.sglang_engine import SGLangEngine
    from lora_conformance.models import resolve_base_model
    from lora_conformance.types import GenerationRequest

    work = Path(tempfile.mkdtemp(prefix="sglang-shutdown-"))
    model = resolve_base_model("synthetic:llama", work / "models")
    req = [GenerationRequest("the old man walked to the river", None, 2, 1)]
    seen = {}
    for how in ("SGLang's Engine.shutdown()", "the plugin's close()"):
        first = SGLangEngine(model, "cpu", "float32", {})
        second = SGLangEngine(model, "cpu", "float32", {"chunked_prefill_size": "16"})
        if how.startswith("SGLang"):
            first.engine.shutdown()
        else:
            first.close()
        time.sleep(3)
        codes = [p.exitcode for p in second._children]
        try:
            second.generate(req)
            answer = "answers"
        except Exception as exc:  # noqa: BLE001 - what the second engine does is the finding
            answer = f"fails: {type(exc).__name__}: {str(exc)[:120]}"
        print(f"after {how} of the first engine: the second engine's processes' exit codes {codes}; it {answer}",
              flush=True)
        seen[how] = codes
        first.close()
        second.close()
        for p in multiprocessing.active_children():
            p.join(timeout=5)
    killed = any(c is not None for c in seen["SGLang's Engine.shutdown()"])
    kept = all(c is None for c in seen["the plugin's close()"])
    return 0 if killed and kept else 1


if __name__ == "__main__":
    sys.exit(main())
