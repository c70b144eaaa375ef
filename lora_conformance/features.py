"""Features are data: the ``feature`` marker names what a suite test certifies.

    @pytest.mark.feature("adapter_semantics/rslora", "use_rslora scales the delta by alpha / sqrt(r)",
                         requires=("rslora",))
    def test_rslora(lora, device, dtype): ...

The id (``suite/name``: lower case, digits, ``_``, ``.``, ``-``) is stable: report rows,
expectations files and CI selections use it, so renaming the test function renames nothing.
Its parametrisations are the feature's cases. ``requires`` lists the engine capabilities
(``lora_conformance.engines.Capability`` values) the feature needs; a test whose engine
lacks one is *not certified*. A ``requires`` marker (module- or class-level) adds to them.

This module imports nothing heavy: the plugin reads markers at collection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

FEATURE_MARKER = "feature"
FEATURE_ID = re.compile(r"^[a-z0-9_]+/[a-z0-9_.\-]+$")
MARKER_HELP = ("feature(id, description, requires=()): the feature a test certifies: a stable id "
               "(suite/name) for reports, expectations and CI, a one-line description, and the engine "
               "capabilities it needs")


class FeatureMarkerError(ValueError):
    """A malformed ``feature`` marker (the message names the test and the field)."""


@dataclass(frozen=True)
class Feature:
    id: str
    description: str
    requires: tuple[str, ...] = field(default_factory=tuple)

    @property
    def suite(self) -> str:
        return self.id.split("/", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "description": self.description, "requires": list(self.requires)}


def parse_marker(mark: Any, where: str) -> Feature:
    """A ``Feature`` from a ``pytest.mark.feature(...)`` mark; errors name ``where`` and the field."""
    args, kwargs = tuple(mark.args), dict(mark.kwargs)
    if len(args) > 2:
        raise FeatureMarkerError(f"{where}: @pytest.mark.feature takes (id, description, requires=...), "
                                 f"got {len(args)} positional arguments")
    fid = args[0] if args else kwargs.pop("id", None)
    desc = args[1] if len(args) > 1 else kwargs.pop("description", None)
    requires = kwargs.pop("requires", ())
    if kwargs:
        raise FeatureMarkerError(f"{where}: @pytest.mark.feature: unknown field(s) {', '.join(sorted(kwargs))}; "
                                 "expected id, description, requires")
    if not isinstance(fid, str) or not FEATURE_ID.match(fid):
        raise FeatureMarkerError(f"{where}: @pytest.mark.feature: id {fid!r} is not of the form suite/name "
                                 "(lower case letters, digits, '_', '.', '-')")
    if not isinstance(desc, str) or not desc.strip():
        raise FeatureMarkerError(f"{where}: @pytest.mark.feature({fid!r}): description must be a non-empty string")
    if isinstance(requires, str):
        requires = (requires,)
    if not all(isinstance(r, str) for r in requires):
        raise FeatureMarkerError(f"{where}: @pytest.mark.feature({fid!r}): requires must be capability names")
    return Feature(fid, desc.strip(), tuple(requires))


def feature_of_item(item: Any) -> Optional[Feature]:
    """The item's feature (its closest ``feature`` marker), or None for an unmarked test."""
    mark = item.get_closest_marker(FEATURE_MARKER)
    return None if mark is None else parse_marker(mark, item.nodeid)


def required_capabilities(item: Any) -> list[str]:
    """Capabilities an item needs: its feature's plus every ``requires`` marker's, in order, once each."""
    needed: list[str] = []
    feature = feature_of_item(item)
    for cap in (feature.requires if feature else ()):
        if cap not in needed:
            needed.append(cap)
    for m in item.iter_markers("requires"):
        for cap in m.args:
            if cap not in needed:
                needed.append(cap)
    return needed


def check_declarations(items: Any) -> None:
    """The collection's feature declarations, before any test runs: every ``feature`` marker well
    formed, each feature id declared by one test function, every required capability a name of the
    engine protocol. FeatureMarkerError names the test."""
    from lora_conformance.engines.base import Capability

    owners: dict[str, str] = {}  # feature id -> the test function that declares it
    for item in items:
        feature = feature_of_item(item)
        if feature is not None:
            function = item.nodeid.split("[", 1)[0]
            if owners.setdefault(feature.id, function) != function:
                raise FeatureMarkerError(f"{function}: feature id {feature.id!r} is already declared by "
                                         f"{owners[feature.id]} (one test function per feature)")
        for cap in required_capabilities(item):
            try:
                Capability.parse(cap)
            except ValueError as exc:
                raise FeatureMarkerError(f"{item.nodeid}: required capability: {exc}") from None
