"""Device faults a vendor's backend could really have, one at a time.

Each is a wrong kernel or a wrong ordering, not a wrong engine: the built-in engine is the
same code on the correct and the faulty device, so a certification that fails on the faulty
one has caught the device. Select one with ``LORA_VDEV_FAULT=<name>`` or
``register(fault="<name>")``; an empty name is the correct device.
"""

from __future__ import annotations

FAULTS = {
    "bf16_matmul_accumulate": "matrix products of bfloat16 inputs keep their running sum in bfloat16 "
                              "(rounded after every product is added) instead of float32",
    "index_select_wraps": "index_select and embedding read row i mod 512 for i >= 512 (a 9-bit row offset)",
    "async_h2d_copy": "a host-to-device copy into device memory that already holds values is not ordered "
                      "before its use: the first operation that reads the destination sees the old "
                      "contents, then the copy lands",
    "reduction_drops_tail": "row-wise reductions over the last dimension (sum, mean, softmax, log_softmax) "
                            "are launched with rows // 4 blocks instead of ceil(rows / 4): the last partial "
                            "block of rows is never computed and reads as zeros",
}

_active: str = ""


class UnknownFaultError(ValueError):
    pass


def activate(name: str) -> None:
    global _active
    name = (name or "").strip()
    if name and name not in FAULTS:
        raise UnknownFaultError(f"vdev fault {name!r}: expected one of {', '.join(FAULTS)} (or empty)")
    _active = name


def active() -> str:
    return _active


def on(name: str) -> bool:
    return _active == name
