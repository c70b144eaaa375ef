"""Find engines by name through the ``lora_conformance.engines`` entry-point group.

A third-party engine registers itself in its own package::

    [project.entry-points."lora_conformance.engines"]
    myengine = "my_pkg.lora:MyEngine"

``--engine`` also accepts ``module:Class`` directly, which helps while developing one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Union

from lora_conformance.engines.base import Engine
from lora_conformance.entry_points import load, targets

GROUP = "lora_conformance.engines"

# Ours: the one list of the engines this package ships (other packages add theirs through GROUP).
_BUILTIN = {
    "builtin": "lora_conformance.engines.builtin:BuiltinEngine",
    "peft": "lora_conformance.engines.peft_engine:PeftEngine",
    "vllm": "lora_conformance.engines.vllm_engine:VllmEngine",
    "openai": "lora_conformance.engines.openai_engine:OpenAIEngine",
    "sglang": "lora_conformance.engines.sglang_engine:SGLangEngine",
    "openvino": "lora_conformance.engines.openvino_engine:OpenVINOEngine",
    "llamacpp": "lora_conformance.engines.llamacpp_engine:LlamaCppEngine",
}


class UnknownEngineError(LookupError):
    pass


def available_engines() -> dict[str, str]:
    """Engine name -> ``module:attr`` target, entry points overriding nothing of ours."""
    return targets(GROUP, _BUILTIN)


def check_engine_name(name: str) -> str:
    """``--engine``'s value, unchanged: a registered name or ``module:Class`` (ValueError otherwise,
    listing the names)."""
    if name not in available_engines() and ":" not in name:
        raise ValueError(f"expected one of {', '.join(sorted(available_engines()))}, or module:Class")
    return name


def engine_class(name: str) -> type[Engine]:
    engines = available_engines()
    target = engines.get(name)
    if target is None:
        if ":" in name:
            target = name
        else:
            import difflib

            close = difflib.get_close_matches(name, list(engines), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UnknownEngineError(
                f"unknown engine {name!r}; {hint}registered engines: {', '.join(sorted(engines))} "
                f"(or give module:Class; `lora-conformance engines` lists them)"
            )
    cls = load(target)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise UnknownEngineError(f"engine {name!r} resolves to {target!r}, which is not an Engine subclass")
    return cls


def create_engine(name: str, model_dir: Path, device: str, dtype: str, args: Mapping[str, str]) -> Engine:
    return engine_class(name)(Path(model_dir), device, dtype, dict(args))


def check_engine_config(engine: str, raw: Mapping[str, Any], source: Union[str, Mapping[str, str]]) -> None:
    """What a run can know before it starts: the engine exists, its optional dependency is
    installed, its args parse. Raises EngineError with a one-line message."""
    from lora_conformance.engines.args import EngineArgError, MissingDependencyError, check_dependencies

    try:
        cls = engine_class(engine)
    except UnknownEngineError as exc:
        raise EngineArgError(str(exc)) from None
    except ImportError as exc:
        raise MissingDependencyError(f"engine {engine!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    check_dependencies(cls)
    cls.parse_args(raw, source)
