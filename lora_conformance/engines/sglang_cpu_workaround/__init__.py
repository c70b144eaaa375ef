"""The one change this project makes to SGLang's environment, and only on a host without an
accelerator: ``pin_memory`` becomes a no-op in SGLang's processes (sgl-project/sglang#31894).

The directory of this package holds a ``sitecustomize.py`` (see its docstring for what it does
and why); the ``sglang`` engine plugin puts the directory first on the PYTHONPATH of the
processes SGLang starts (``environment``), and the report, the certification matrix and
docs/sglang.md name the workaround wherever a result is shown.
"""

from __future__ import annotations

from pathlib import Path

from lora_conformance.engines.sglang_cpu_workaround.sitecustomize import ENV, accelerator_present

DIR = Path(__file__).resolve().parent
LABEL = "pin_memory workaround (sglang#31894)"
LINK = "https://github.com/sgl-project/sglang/issues/31894"


def applies(device_type: str) -> bool:
    """True where the workaround is needed and allowed: a cpu run on a host with no accelerator
    (torch.accelerator, or CUDA, unavailable). Never where pinned memory exists."""
    if device_type != "cpu":
        return False
    import torch

    return not accelerator_present(torch)


def environment(base: dict) -> dict:
    """``base`` (an environment) with the workaround on: this directory first on PYTHONPATH, and
    the switch the sitecustomize reads."""
    env = dict(base)
    paths = [str(DIR)] + [p for p in env.get("PYTHONPATH", "").split(":") if p and p != str(DIR)]
    env["PYTHONPATH"] = ":".join(paths)
    env[ENV] = "1"
    return env
