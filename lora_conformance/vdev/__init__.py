"""``vdev``: a reference virtual accelerator written in Python, the worked example of a
privateuse1 backend that a vendor certifies with this project.

It is registered on request only: nothing happens when this package is imported. The device
layer registers it when a run asks for ``--device vdev`` (through the ``lora_conformance.devices``
entry-point group, where a vendor registers theirs), or a program does it explicitly::

    import lora_conformance.vdev
    lora_conformance.vdev.register()            # or register(fault="bf16_matmul_accumulate")
    x = torch.ones(3, device="vdev")

What it is, honestly:

* Memory: every ``vdev`` tensor is a wrapper (:class:`~lora_conformance.vdev.tensor.VdevTensor`) over
  an ordinary host tensor. Kernels are torch's cpu kernels, run on the host.
* Execution: synchronous and in one order. Streams and events exist and keep torch's API, but
  since nothing runs ahead of the host every wait is already satisfied (see ``module.py``).
* What it lacks, said as "not supported": graph capture, a stream trace hook (so the suites'
  race detector cannot listen), pinned host memory, device generators (it seeds the host's).
* Faults a real backend could have are injectable (``LORA_VDEV_FAULT`` or ``register(fault=...)``;
  see ``faults.py``), so the certification can be shown to catch them.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

NAME = "vdev"
FAULT_ENV = "LORA_VDEV_FAULT"

_registered = False


def register(fault: Optional[str] = None) -> str:
    """Make ``vdev`` a torch device in this process and return its name.

    Idempotent; every call (re)applies the fault setting: ``fault`` if given, else the
    ``LORA_VDEV_FAULT`` environment variable, else none. torch has one privateuse1 slot per
    process, so this fails clearly when another backend already took it.
    """
    global _registered
    first = _first_import()
    if first is not None:
        return first.register(fault)
    from lora_conformance.vdev import faults

    faults.activate(fault if fault is not None else os.environ.get(FAULT_ENV, ""))
    if _registered:
        return NAME
    import torch

    taken = torch._C._get_privateuse1_backend_name()
    if taken not in ("privateuseone", NAME):
        raise RuntimeError(f"cannot register {NAME!r}: this process's privateuse1 backend is already {taken!r}")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from lora_conformance.vdev import kernels, module

    if taken == "privateuseone":
        device_module = module.VdevModule()
        device_module.package = sys.modules[__name__]  # see _first_import
        _setup_privateuseone_for_python_backend(NAME, device_module)
    kernels.install()
    _registered = True
    return NAME


def is_registered() -> bool:
    first = _first_import()
    return first.is_registered() if first is not None else _registered


_SUBMODULES = ("faults", "kernels", "module", "tensor")


def _first_import():
    """The import of this package that registered vdev in this process, when it is not this one.

    torch keeps one privateuse1 backend per process, with the kernels and the tensor class of the
    import that registered it. A test runner that restores ``sys.modules`` after an in-process run
    (pytester does) makes the next import of this package, or of one of its modules, a second
    copy, whose kernels and tensor class would not be the device's (torch refuses a second
    fallback, and a tensor of one copy dispatched to the other copy's kernels recursed). So the
    registering copy stays the device: its package and modules are put back in ``sys.modules``,
    and a call to a second copy goes to it.
    """
    torch = sys.modules.get("torch")  # vdev registered means torch is imported; never import it here
    owner = getattr(getattr(torch, NAME, None), "package", None)
    if owner is None:
        return None
    sys.modules[__name__] = owner
    for sub in _SUBMODULES:
        if hasattr(owner, sub):
            sys.modules[f"{__name__}.{sub}"] = getattr(owner, sub)
    return None if owner.__dict__ is globals() else owner


_first_import()  # importing a second copy of the package gives the first, once vdev is registered
