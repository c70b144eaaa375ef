"""Engine arguments as data: each engine declares its own once, one parser checks them all.

An engine's arguments are a frozen dataclass (nano-vllm's ``Config`` style): one field per
argument, its type from the annotation, its default and a one-line meaning from ``arg()``;
cross-field rules live in ``__post_init__``. The standard arguments the suites ask for
(``STANDARD_ARGS``) are declared here once for all engines; an engine maps each one it
honours onto its own (``Engine.standard_args``: a rename, an inversion, the one value it
always behaves as, ...), and takes no other. ``parse_engine_args`` turns ``--engine-arg``
strings into the dataclass; every error is one line naming the argument, the value, where
it came from and what was expected, and an unknown name gets a "did you mean".

Nothing here imports torch or an engine's library: the plugin checks a run's engine args in
``pytest_configure``, before any test and before any engine starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from lora_conformance.errors import EngineError, UnsupportedFeatureError

SUITE_SOURCE = "requested by the test"  # where a suite's own engine args come from


class EngineArgError(EngineError, ValueError):
    """A bad engine argument: unknown name, wrong type or value. The message is one line."""


class MissingDependencyError(EngineError, ImportError):
    """The engine's optional dependency is not installed. The message is one line."""


# ---- declaring -------------------------------------------------------------------------


def arg(default: Any, help: str = "", *, choices: Iterable[Any] = (), minimum: Optional[float] = None,
        check: Optional[Callable[[Any], Any]] = None) -> Any:
    """One engine argument: a dataclass field with its default and meaning. ``choices`` and
    ``minimum`` are checked by the parser; ``check`` converts or validates a parsed value
    further (it raises ValueError with what was expected). An empty ``help`` on a field named
    like a standard argument takes the standard argument's meaning."""
    meta = {"help": help, "choices": tuple(choices), "minimum": minimum, "check": check}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ArgSpec:
    """What ``describe`` prints and the parser enforces for one argument."""

    name: str
    type: type  # int, float, bool or str
    default: Any
    help: str
    optional: bool = False  # None is a value (the default, computed by the engine: see help)
    choices: tuple = ()
    minimum: Optional[float] = None
    check: Optional[Callable[[Any], Any]] = None

    @property
    def type_name(self) -> str:
        name = "choice" if self.choices else self.type.__name__
        return name + " or none" if self.optional else name

    def expected(self) -> str:
        if self.choices:
            shown = [str(c) for c in self.choices]
            return f"{shown[0]} or {shown[1]}" if len(shown) == 2 else "one of " + ", ".join(shown)
        if self.type is bool:
            return "a boolean (1/0, true/false, yes/no, on/off)"
        if self.type is int:
            return "an integer" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
        if self.type is float:
            return "a number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
        return "a string"


# The engine configurations the suites ask for, in one vocabulary for every engine.
STANDARD_ARGS: dict[str, ArgSpec] = {s.name: s for s in (
    ArgSpec("max_loras_per_batch", int, None, "adapters (not counting the base) active in one forward", minimum=1),
    ArgSpec("max_loaded_loras", int, None, "adapters the engine holds at once (>= max_loras_per_batch)", minimum=1),
    ArgSpec("max_rank", int, None, "the largest LoRA rank the engine accepts"),
    ArgSpec("eviction", str, None, "which loaded adapter makes room for a new one", choices=("lru", "fifo", "none")),
    ArgSpec("prefix_cache", bool, None, "reuse the KV cache of a shared prompt prefix (per adapter)"),
    ArgSpec("overlap_loading", bool, None, "copy adapter weights to the device while a batch runs"),
    ArgSpec("graphs", bool, None, "capture and replay device graphs"),
    ArgSpec("tensor_parallel", int, None, "devices the model (and its LoRA) is sharded over (1: none)", minimum=1),
    ArgSpec("lora_backend", str, None, "the engine's own LoRA kernel backend name"),
    ArgSpec("chunked_prefill_size", int, None, "prefill tokens per step (0: unchunked)", minimum=0),
)}


def arg_specs(args_cls: type) -> list[ArgSpec]:
    """The declared arguments of an engine's dataclass, in declaration order."""
    hints = typing.get_type_hints(args_cls, vars(sys.modules[args_cls.__module__]))
    specs = []
    for f in dataclasses.fields(args_cls):
        if not f.init or f.name.startswith("_"):
            continue
        tp, optional = _base_type(hints[f.name])
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        help_ = meta.get("help") or (STANDARD_ARGS[f.name].help if f.name in STANDARD_ARGS else "")
        specs.append(ArgSpec(f.name, tp, default, help_, optional or default is None, meta.get("choices", ()),
                             meta.get("minimum"), meta.get("check")))
    return specs


def _base_type(tp: Any) -> tuple[type, bool]:
    if typing.get_origin(tp) is Union:
        members = [t for t in typing.get_args(tp) if t is not type(None)]
        return (members[0] if len(members) == 1 and isinstance(members[0], type) else str), True
    return (tp if tp in (int, float, bool) else str), False


# ---- how an engine takes a standard argument ------------------------------------------


class StandardMapping:
    """How an engine honours one standard argument. Called with the (normalised) value string,
    it returns the engine's own arguments it stands for; ``text`` says so for ``describe``."""

    text = ""

    def __call__(self, value: str) -> dict[str, str]:
        raise NotImplementedError


class Rename(StandardMapping):
    def __init__(self, own: str, invert: bool = False):
        self.own, self.invert = own, invert
        self.text = f"as {'not ' if invert else ''}{own}"

    def __call__(self, value: str) -> dict[str, str]:
        if self.invert:
            value = "0" if value == "1" else "1"
        return {self.own: value}


class Only(StandardMapping):
    """A standard argument the engine has no knob for: only the value it always behaves as.
    Another value is refused (UnsupportedFeatureError): the engine cannot run that way."""

    def __init__(self, engine: str, key: str, supported: str):
        self.engine, self.key, self.supported = engine, key, supported
        self.text = f"only {supported} (the engine always behaves so)"

    def __call__(self, value: str) -> dict[str, str]:
        if value != self.supported:
            raise UnsupportedFeatureError(
                f"engine {self.engine!r} cannot run with {self.key}={value} (only {self.key}={self.supported})")
        return {}


class Ignore(StandardMapping):
    def __init__(self, why: str):
        self.text = f"accepted, no effect ({why})"

    def __call__(self, value: str) -> dict[str, str]:
        return {}


class Via(StandardMapping):
    def __init__(self, fn: Callable[[str], dict[str, str]], text: str):
        self.fn, self.text = fn, text

    def __call__(self, value: str) -> dict[str, str]:
        return self.fn(value)


# ---- parsing ---------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _source_of(sources: Union[str, Mapping[str, str]], key: str) -> str:
    if isinstance(sources, str):
        return sources
    return sources.get(key, "the engine's arguments")


def _convert(engine: str, spec: ArgSpec, raw: Any, source: str) -> Any:
    text = str(raw).strip()

    def bad(problem: str = "") -> EngineArgError:
        return EngineArgError(f"engine {engine!r}: engine arg {spec.name}={text!r}: "
                              f"{problem or 'expected ' + spec.expected()} (from {source})")

    if spec.optional and text.lower() in ("", "none"):
        return None
    if spec.type is bool:
        low = text.lower()
        if low not in _TRUE | _FALSE:
            raise bad()
        value: Any = low in _TRUE
    elif spec.type in (int, float):
        try:
            value = spec.type(text)
        except ValueError:
            raise bad() from None
        if spec.minimum is not None and value < spec.minimum:
            raise bad()
    else:
        value = text
    if spec.choices and value not in spec.choices:
        raise bad()
    if spec.check is not None:
        try:
            value = spec.check(value)
        except ValueError as exc:
            raise bad(" ".join(str(exc).split())) from None
    return value


def _normalised(spec: ArgSpec, value: Any) -> str:
    """A standard value as the mappings compare it: booleans as 1/0."""
    return ("1" if value else "0") if spec.type is bool else str(value)


def unknown_arg_message(engine: str, key: str, known: Iterable[str], source: str) -> str:
    known = sorted(set(known))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    note = " (a standard arg this engine does not take)" if key in STANDARD_ARGS else ""
    return (f"engine {engine!r}: unknown engine argument {key!r}{note} (from {source}); {hint}"
            f"known: {', '.join(known) or 'none'} (see `lora-conformance engines describe {engine}`)")


def parse_engine_args(args_cls: type, raw: Mapping[str, Any],
                      source: Union[str, Mapping[str, str]] = "the engine's arguments", *, engine: str,
                      standard: Optional[Mapping[str, Callable[[str], dict[str, str]]]] = None) -> Any:
    """``--engine-arg`` strings -> the engine's argument dataclass ``args_cls``.

    Standard arguments are type-checked against ``STANDARD_ARGS`` and mapped through ``standard``
    (the engine's ``standard_args``; an own argument given explicitly wins); the rest must be
    the engine's own fields. Raises EngineArgError (one line) for a name or value the engine
    does not know, UnsupportedFeatureError for a standard value the engine cannot honour.
    ``source``: where the values came from (one string, or one per key)."""
    specs = {s.name: s for s in arg_specs(args_cls)}
    mappings = standard or {}
    known = set(specs) | set(mappings)
    for key in raw:
        if key not in known:
            raise EngineArgError(unknown_arg_message(engine, key, known, _source_of(source, key)))
    own: dict[str, Any] = {k: v for k, v in raw.items() if k not in mappings}
    origin = {k: _source_of(source, k) for k in own}
    for key, mapping in mappings.items():
        if key not in raw:
            continue
        spec = STANDARD_ARGS.get(key)
        value = str(raw[key]).strip()
        if spec is not None:
            value = _normalised(spec, _convert(engine, spec, raw[key], _source_of(source, key)))
        try:
            translated = mapping(value)
        except UnsupportedFeatureError as exc:
            raise UnsupportedFeatureError(f"{exc} (from {_source_of(source, key)})") from None
        for own_key, own_value in translated.items():
            if own_key not in own:
                own[own_key] = own_value
                origin[own_key] = f"standard arg {key}={raw[key]}, {_source_of(source, key)}"
    values = {k: _convert(engine, specs[k], v, origin[k]) for k, v in own.items()}
    try:
        return args_cls(**values)
    except ValueError as exc:
        if isinstance(exc, EngineArgError):
            raise
        shown = ", ".join(sorted({origin[k] for k in own})) or "the defaults"
        raise EngineArgError(f"engine {engine!r}: {' '.join(str(exc).split())} (from {shown})") from None


# ---- what a class declares -------------------------------------------------------------


def _defining(cls: type, attr: str) -> type:
    return next(k for k in cls.__mro__ if attr in vars(k))


def class_capabilities(cls: type, cfg: Any, model_dir: Any, device: str):
    """``cls.declared_capabilities``, or None where it may not describe ``cls``: a subclass that
    changes the constructor (where an engine fills ``capabilities``) without declaring again
    is asked by starting it."""
    if not issubclass(_defining(cls, "declared_capabilities"), _defining(cls, "__init__")):
        return None
    return cls.declared_capabilities(cfg, model_dir, device)


# ---- start-up checks -------------------------------------------------------------------


def capability_list(value: str) -> str:
    """An arg naming capabilities (comma or space separated): each must be in the vocabulary."""
    from lora_conformance.capabilities import Capability

    for c in value.replace(",", " ").split():
        Capability.parse(c)  # ValueError listing the vocabulary
    return value


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_modules(engine_cls: type) -> list[str]:
    """The engine's required top-level modules that cannot be imported here (found with
    ``importlib.util.find_spec``: nothing heavy is imported)."""
    return [m for m in getattr(engine_cls, "requires", ()) if not _importable(m)]


def install_hint(engine_cls: type) -> str:
    extra = getattr(engine_cls, "extra", None)
    if extra:
        return f"pip install 'lora-conformance[{extra}]'"
    return "pip install " + " ".join(getattr(engine_cls, "requires", ()))


def check_dependencies(engine_cls: type) -> None:
    missing = missing_modules(engine_cls)
    if missing:
        name = getattr(engine_cls, "name", engine_cls.__name__)
        raise MissingDependencyError(f"engine {name!r} needs {', '.join(missing)}, which is not installed here: "
                                     f"{install_hint(engine_cls)}")


def engine_arg_pairs(items: Any) -> dict[str, str]:
    """``--engine-arg KEY=VALUE`` strings -> ``{KEY: VALUE}`` (ValueError naming a malformed one)."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"engine argument {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
