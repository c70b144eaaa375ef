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

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Optional

FEATURE_MARKER = "feature"
# The feature id of a test file's collection (a file that fails to import has no test functions).
COLLECTION = "(collection)"
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
    from lora_conformance.capabilities import Capability

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


# ---- the one reading of a feature's identity: markers, node ids and source ---------------------


def feature_of(nodeid: str) -> tuple[str, str]:
    """(suite, feature id) of a test id.

    ``suites/test_mixed_batch.py::test_nearest_reference_routing[cpu-float32]`` ->
    ``("mixed_batch", "mixed_batch/nearest_reference_routing")``. Parameters and classes
    are dropped: a feature is the test function, its cases are the parametrizations.
    """
    path, _, rest = nodeid.partition("::")
    stem = path.rsplit("/", 1)[-1]
    stem = stem[:-3] if stem.endswith(".py") else stem
    suite = stem[5:] if stem.startswith("test_") else stem
    if not rest:
        return suite, f"{suite}/{COLLECTION}"
    function = rest.split("[", 1)[0].rsplit("::", 1)[-1]
    function = function[5:] if function.startswith("test_") else function
    return suite, f"{suite}/{function}"


def item_feature_id(item: Any) -> str:
    """The feature id a collected item is reported under: its marker's id, else its node id's (a
    malformed marker is the plugin's usage error; here it falls back to the node id)."""
    try:
        feature = feature_of_item(item)
    except FeatureMarkerError:
        feature = None
    return feature.id if feature is not None else feature_of(item.nodeid)[1]


def _is_feature_mark(func: ast.expr) -> bool:
    # pytest.mark.feature(...) or mark.feature(...)
    if not (isinstance(func, ast.Attribute) and func.attr == "feature"):
        return False
    owner = func.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (isinstance(owner, ast.Name)
                                                                          and owner.id == "mark")


def declared_in_source(source: str) -> list[str]:
    """Feature ids of the ``feature`` markers written literally in a test file."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # pytest reports the file as a collection error
    ids = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_feature_mark(node.func):
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "id"), None)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                ids.append(arg.value)
    return ids
