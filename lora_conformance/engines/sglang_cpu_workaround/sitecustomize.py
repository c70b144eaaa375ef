"""SGLang on a host without an accelerator: ``pin_memory`` becomes a no-op (sgl-project/sglang#31894).

SGLang's LoRA code asks for pinned host memory on every batch, whatever the device
(0.5.15.post1: ``srt/lora/layers.py`` lines 106, 291, 439, 533, 615, 698;
``srt/lora/backend/torch_backend.py`` 224-243, ``chunked_backend.py``, ``triton_backend.py``).
PyTorch refuses pinned memory where no accelerator exists ("Cannot access accelerator device
when none is available" / "requires a CUDA or other accelerator backend"), so with LoRA on,
SGLang's CPU engine fails on its first LoRA batch. Pinning only speeds up host-to-device copies;
on a CPU-only host there is no such copy, so dropping the request changes no result.

This file is a ``sitecustomize``: the ``sglang`` engine plugin puts its directory first on the
PYTHONPATH of SGLang's processes (the launched server, or the scheduler processes that the
offline ``sglang.Engine`` spawns) and sets ``LORA_CONFORMANCE_SGLANG_PIN_MEMORY_WORKAROUND=1``,
and only where the device is ``cpu`` and no accelerator is present. It patches nothing unless
that variable is set, and nothing where ``torch.accelerator`` (or CUDA) is available: a device
with pinned memory keeps SGLang exactly as shipped. No SGLang file is changed.

What it changes, in the processes that have it: ``Tensor.pin_memory()`` returns the tensor
itself, and the ``pin_memory=True`` argument of torch's factory functions is dropped. Both only
replace an error with the result the call would have had without pinning.
"""

from __future__ import annotations

import functools
import os

ENV = "LORA_CONFORMANCE_SGLANG_PIN_MEMORY_WORKAROUND"
FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
             "ones_like", "full_like", "empty_strided", "randn", "rand", "randint")


def accelerator_present(torch) -> bool:
    """Whether torch sees an accelerator (``torch.accelerator``, which covers every backend). A torch
    without that API counts as having one: the workaround is then never applied (it cannot tell)."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "is_available"):
        return True
    try:
        return bool(acc.is_available())
    except Exception:  # noqa: BLE001 - a backend that cannot answer: do not patch
        return True


def _unpinned(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    call.__lora_conformance_unpinned__ = True
    return call


def apply() -> bool:
    """Make pin_memory a no-op in this process; True when it did (see the module docstring)."""
    if os.environ.get(ENV) != "1":
        return False
    import torch

    if accelerator_present(torch):
        return False
    if getattr(torch.Tensor.pin_memory, "__lora_conformance_unpinned__", False):
        return True  # applied already

    def pin_memory(self, *args, **kwargs):
        return self

    pin_memory.__lora_conformance_unpinned__ = True
    torch.Tensor.pin_memory = pin_memory
    for name in FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "__lora_conformance_unpinned__", False):
            setattr(torch, name, _unpinned(fn))
    return True


if __name__ == "sitecustomize":  # run by the interpreter at start-up, not when imported by the plugin
    apply()
