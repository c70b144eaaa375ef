"""Engines under test. ``base`` defines the interface; ``registry`` finds engines by name."""

from lora_conformance.engines.base import (
    ALL_CAPABILITIES,
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterNotLoadedError,
    CapacityError,
    Capability,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    UnsupportedFeatureError,
)
from lora_conformance.engines.registry import available_engines, create_engine, engine_class

__all__ = [
    "ALL_CAPABILITIES",
    "AdapterFormatError",
    "AdapterIncompatibleError",
    "AdapterNotLoadedError",
    "CapacityError",
    "Capability",
    "Engine",
    "EngineError",
    "EngineFailure",
    "Limits",
    "UnsupportedFeatureError",
    "available_engines",
    "create_engine",
    "engine_class",
]
