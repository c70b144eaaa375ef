"""Engines under test. ``base`` defines the interface; ``registry`` finds engines by name."""

from lora_conformance.engines.base import (
    ALL_CAPABILITIES,
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterInUseError,
    AdapterNotLoadedError,
    CapacityError,
    Capability,
    Engine,
    EngineError,
    EngineFailure,
    Limits,
    RequestHandle,
    UnsupportedFeatureError,
)
from lora_conformance.engines.registry import available_engines, create_engine, engine_class

__all__ = [
    "ALL_CAPABILITIES",
    "AdapterFormatError",
    "AdapterIncompatibleError",
    "AdapterInUseError",
    "AdapterNotLoadedError",
    "CapacityError",
    "Capability",
    "Engine",
    "EngineError",
    "EngineFailure",
    "Limits",
    "RequestHandle",
    "UnsupportedFeatureError",
    "available_engines",
    "create_engine",
    "engine_class",
]
