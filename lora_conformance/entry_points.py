"""Where other packages plug in: named ``module:attr`` targets, ours first, then entry points.

Engines (group ``lora_conformance.engines``) and device backends (``lora_conformance.devices``)
are found the same way: this package's own list, then whatever installed packages register under
the group (a name of ours is never overridden). Standard library only.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Mapping


def targets(group: str, ours: Mapping[str, str]) -> dict[str, str]:
    """Name -> ``module:attr``: ``ours``, then the group's entry points for other names."""
    found = dict(ours)
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep.value)
    return found


def load(target: str, default_attr: str = "") -> Any:
    """The object a ``module:attr`` target (``attr`` may be dotted; ``default_attr`` where none) names."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in (attr or default_attr).split(".") if (attr or default_attr) else []:
        obj = getattr(obj, part)
    return obj
