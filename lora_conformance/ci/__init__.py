"""CI registration: suite files declare, at module top level, where CI runs them.

    from lora_conformance.ci import register_cpu_ci, register_xpu_ci

    register_cpu_ci(est_time=40, suite="per-commit")
    register_xpu_ci(est_time=300, suite="nightly-full", nightly=True)

The calls do nothing when the module is imported: ``lora_conformance.ci.registry`` reads
them statically (ast) from the source, so listing, sharding and selecting files never
imports a suite (and never touches torch or an accelerator).
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "register_ci",
    "register_cpu_ci",
    "register_cuda_ci",
    "register_xpu_ci",
    "register_npu_ci",
]


def register_ci(hw: str, est_time: float, suite: str, nightly: bool = False,
                disabled: Optional[str] = None) -> None:
    """Run this file on hardware ``hw`` in CI suite ``suite`` (about ``est_time`` seconds).

    ``nightly=True`` runs it only with ``--ci-nightly``; ``disabled="reason"`` lists it
    without running it. Arguments must be literals: they are read from the source.
    """
    return None


def register_cpu_ci(est_time: float, suite: str, nightly: bool = False, disabled: Optional[str] = None) -> None:
    """``register_ci(CPU, ...)`` (device-layer constant)."""
    return None


def register_cuda_ci(est_time: float, suite: str, nightly: bool = False, disabled: Optional[str] = None) -> None:
    """``register_ci(CUDA, ...)`` (device-layer constant)."""
    return None


def register_xpu_ci(est_time: float, suite: str, nightly: bool = False, disabled: Optional[str] = None) -> None:
    """``register_ci(XPU, ...)`` (device-layer constant)."""
    return None


def register_npu_ci(est_time: float, suite: str, nightly: bool = False, disabled: Optional[str] = None) -> None:
    """``register_ci(NPU, ...)`` (device-layer constant)."""
    return None
