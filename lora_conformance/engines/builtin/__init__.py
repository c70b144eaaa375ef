"""The built-in multi-LoRA engine (``--engine builtin``) and its fault catalogue."""

from lora_conformance.engines.builtin.builtin_engine import BuiltinEngine
from lora_conformance.engines.builtin.faults import FAULTS, Faults

__all__ = ["BuiltinEngine", "FAULTS", "Faults"]
