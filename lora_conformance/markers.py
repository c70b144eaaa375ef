"""The suites' markers: the help line each is registered with, and what an item's markers say.

The ``feature`` and ``requires`` markers are read by ``lora_conformance.features``. Standard
library only: the plugin registers these lines while pytest starts.
"""

from __future__ import annotations

from typing import Any, Optional

from lora_conformance.devices import SHORTHAND_TYPES
from lora_conformance.features import MARKER_HELP as FEATURE_MARKER_HELP

MARKERS = (
    f"device(*types): run only on these device types ({', '.join(SHORTHAND_TYPES)}, or a vendor type)",
    *(f"{t}: shorthand for device({t!r})" for t in SHORTHAND_TYPES),
    FEATURE_MARKER_HELP,
    "requires(*capabilities): engine capabilities the test needs; without them it is skipped as not certified",
    "base_model(kind): the base model a suite needs (decoder, moe, encoder) when it differs from --base-model",
    "slow: heavier parametrisations, deselect with -m 'not slow'",
)


def device_types_of(item: Any) -> Optional[set[str]]:
    """The device types an item is marked for (``device(...)`` and the shorthands), or None: any."""
    types: set[str] = set()
    found = False
    for m in item.iter_markers("device"):
        found = True
        types.update(m.args)
    for name in SHORTHAND_TYPES:
        if item.get_closest_marker(name) is not None:
            found = True
            types.add(name)
    return types if found else None


def base_model_kind(item: Any) -> Optional[str]:
    """The ``base_model(kind)`` an item asks for, or None: the run's --base-model."""
    m = item.get_closest_marker("base_model")
    return m.args[0] if m and m.args else None
