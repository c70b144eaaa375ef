"""Every option of the plugin, declared once: command line, ``LORA_CONFORMANCE_*`` env, ini key.

Precedence: command line, then environment, then ini, then the default. ``resolve`` records
where each value came from, so a bad value's usage error can say so and the report header
can echo every resolved setting; ``resolve_settings`` turns them into the run's ``Settings``.
No torch import here (the validators' owners load inside ``resolve_settings``).

The same table declares ``lora-conformance certify``'s options (``add_arguments``), which it hands
on to pytest as given (``as_pytest_arguments``): an option is declared, documented and checked
once, wherever it is typed.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from lora_conformance.checkpoints import DTYPE_NAMES
from lora_conformance.models import BASE_QUANT_SCHEMES
from lora_conformance.settings import Settings, default_cache_dir

GROUP = "lora-conformance"
ENV_PREFIX = "LORA_CONFORMANCE_"


@dataclass(frozen=True)
class Option:
    name: str  # dest, also the ini key
    flag: str
    help: str
    default: Any = None
    choices: Optional[tuple[str, ...]] = None
    multiple: bool = False  # repeatable on the command line; comma/space separated in env and ini
    is_flag: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("device", "--device", "device under test: cpu, cuda[:N], xpu[:N], any torch device type, or auto", "cpu"),
    Option("engine", "--engine", "engine under test (a registered name, or module:Class)", "builtin"),
    Option("engine_arg", "--engine-arg", "engine argument KEY=VALUE (repeatable)", (), multiple=True),
    Option(
        "base_model",
        "--base-model",
        "synthetic:llama, synthetic:moe, synthetic:encoder, or a local HF checkpoint directory",
        "synthetic:llama",
    ),
    Option("base_quant", "--base-quant", "the base model quantised by this scheme, the LoRA in float; the reference is "
           "HF + PEFT on the dequantised base (docs/quantized-bases.md)", "none", choices=BASE_QUANT_SCHEMES),
    Option("dtype", "--dtype", "dtype of the engine under test (default: float32 on cpu, bfloat16 elsewhere)",
           None, choices=DTYPE_NAMES),
    Option("reference_device", "--reference-device", "device of the HF+PEFT reference", "cpu"),
    Option("reference_dtype", "--reference-dtype", "dtype of the HF+PEFT reference", "float32",
           choices=DTYPE_NAMES),
    Option("lora_cache", "--lora-cache", "directory for synthetic models, adapters and cached references "
           "(default: the user cache directory)", None),
    Option("lora_refresh_references", "--lora-refresh-references", "recompute cached reference outputs",
           False, is_flag=True),
    Option("lora_threads", "--lora-threads", "torch intra-op threads per process: a number, or auto (cores // "
           "pytest-xdist workers; OMP_NUM_THREADS, when set, is then left to torch)", "auto"),
    Option("lora_test_timeout", "--lora-test-timeout", "time budget in seconds for each phase (setup, call, "
           "teardown) of a test; past it the test fails with a message and the run goes on (0: none)", "600"),
    Option("lora_report", "--lora-report", "write report.json/md/html and badge.svg to this directory", None),
    Option("expectations", "--expectations", "expectations file (feature -> xfail/skip with reason)", None),
    Option("lora_certified", "--lora-certified", "a certified run (what a published badge requires): the whole bundled "
           "suite, waivers naming their upstream issue and suite version, stale ones re-confirmed "
           "(docs/certifying.md)", False, is_flag=True),
    Option("profile", "--profile", "certification profile: fast (small synthetic bases, ranks to 64) or full "
           "(real shapes: a Qwen2.5-1.5B-shaped base, a 64-expert MoE, ranks 1-256, 64 adapters, 8k prompts; "
           "lora_conformance/models/profiles.py)", "fast", choices=("fast", "full")),
    Option("ci_hw", "--ci-hw", "run only suite files registered for this hardware (cpu, cuda, xpu, npu, ...)", None),
    Option("ci_suite", "--ci-suite", "with --ci-hw: the registered suite name", None),
    Option("ci_nightly", "--ci-nightly", "with --ci-hw: include nightly registrations", False, is_flag=True),
    Option("ci_partition", "--ci-partition", "with --ci-hw: run shard i of n (i/n, 0-based)", None),
    Option("ci_durations", "--ci-durations", "with --ci-partition: measured durations (JUnit XML, report.json or "
           "{file: seconds} JSON) that override est_time; default suites/ci_durations.json", None),
)

BY_NAME = {o.name: o for o in OPTIONS}


class OptionError(pytest.UsageError):
    pass


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "LoRA conformance (each option also reads LORA_CONFORMANCE_<NAME> and the ini key <name>)")
    for o in OPTIONS:
        if o.is_flag:
            group.addoption(o.flag, action="store_true", dest=o.name, default=None, help=o.help)
            parser.addini(o.name, o.help, type="bool", default=None)
        elif o.multiple:
            group.addoption(o.flag, action="append", dest=o.name, default=None, metavar="KEY=VALUE", help=o.help)
            parser.addini(o.name, o.help, type="args", default=[])
        else:
            group.addoption(o.flag, action="store", dest=o.name, default=None, help=o.help)
            parser.addini(o.name, o.help, default=None)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _from_environment(o: Option) -> Optional[tuple[Any, str]]:
    env = os.environ.get(o.env)
    if env is None:
        return None
    if o.is_flag:
        low = env.strip().lower()
        if low not in _TRUE | _FALSE:
            raise OptionError(f"{o.env}={env!r} (environment): expected one of 1/0/true/false/yes/no")
        return low in _TRUE, f"environment {o.env}"
    if o.multiple:
        return [p for p in env.replace(",", " ").split() if p], f"environment {o.env}"
    return env, f"environment {o.env}"


def _given(value: Any) -> bool:
    return value not in (None, [], (), False)


def _raw(config: pytest.Config, o: Option) -> tuple[Any, str]:
    cli = config.getoption(o.name, default=None)
    if _given(cli):
        return cli, "command line"
    env = _from_environment(o)
    if env is not None:
        return env
    ini = config.getini(o.name)
    if ini not in (None, [], ""):
        return ini, f"ini key {o.name}"
    return o.default, "default"


@dataclass
class Resolved:
    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def source(self, name: str) -> str:
        return self.sources[name]


def resolve(config: pytest.Config, validators: Optional[dict[str, Callable[[Any], Any]]] = None) -> Resolved:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        value, source = _raw(config, o)
        if o.choices and value is not None and value not in o.choices:
            raise OptionError(
                f"{o.flag}={value!r} (from {source}): expected one of {', '.join(o.choices)}"
            )
        if validators and o.name in validators and value is not None:
            try:
                value = validators[o.name](value)
            except (ValueError, LookupError) as exc:
                raise OptionError(f"{o.flag}={value!r} (from {source}): {exc}") from None
        values[o.name] = value
        sources[o.name] = source
    return Resolved(values, sources)


# ---- the run's settings -----------------------------------------------------------------------


def resolve_settings(config: pytest.Config) -> Settings:
    """The run's settings from these options (command line, environment, ini, default), each value
    checked by its owner, and the engine's configuration checked before
    any test or engine (its optional dependency installed, its args parsed): an OptionError (a
    usage error of one line, naming where the bad value came from) otherwise."""
    from lora_conformance import devices, parallel
    from lora_conformance.engines.args import engine_arg_pairs
    from lora_conformance.engines.registry import check_engine_name
    from lora_conformance.models import check_base_model_spec
    from lora_conformance.time_budget import parse_seconds

    r = resolve(config, validators={
        "engine_arg": engine_arg_pairs,
        "engine": check_engine_name,
        "base_model": check_base_model_spec,
        "lora_threads": parallel.parse_threads,
        "lora_test_timeout": parse_seconds,
    })
    try:
        device = devices.resolve_device(r["device"], parallel.xdist_worker_index())
    except ValueError as exc:
        accepted = ("; accepted: cpu, cuda[:N], xpu[:N], a registered torch device type, auto"
                    if isinstance(exc, devices.DeviceError) else "")
        raise OptionError(f"--device={r['device']!r} (from {r.source('device')}): {exc}{accepted}") from None
    cache = Path(r["lora_cache"]).expanduser() if r["lora_cache"] else default_cache_dir()
    from lora_conformance.models import profiles

    profile = profiles.get(r["profile"])  # its models and reference device where those were not given
    base_model = r["base_model"] if r.source("base_model") != "default" else profile.models["decoder"]
    reference_device = r["reference_device"]
    if profile.reference_on_device and r.source("reference_device") == "default" and devices.device_type(device) != "cpu":
        reference_device = device
    settings = Settings(
        device=device,
        device_spec=r["device"],
        engine=r["engine"],
        engine_args=r["engine_arg"] or {},
        base_model=base_model,
        base_quant=r["base_quant"],
        dtype=r["dtype"] or devices.default_dtype_for(device),
        reference_device=reference_device,
        reference_dtype=r["reference_dtype"],
        cache_dir=cache,
        refresh_references=bool(r["lora_refresh_references"]),
        report_dir=Path(r["lora_report"]) if r["lora_report"] else None,
        expectations=Path(r["expectations"]) if r["expectations"] else None,
        certified=bool(r["lora_certified"]),
        ci_hw=r["ci_hw"],
        ci_suite=r["ci_suite"],
        ci_nightly=bool(r["ci_nightly"]),
        ci_partition=r["ci_partition"],
        ci_durations=Path(r["ci_durations"]) if r["ci_durations"] else None,
        test_timeout=r["lora_test_timeout"],
        profile=profile.name,
        sources=dict(r.sources),
        threads=parallel.thread_share(parallel.cpu_cores(), parallel.xdist_workers(config), r["lora_threads"],
                                      r.source("lora_threads")),
    )
    _check_engine_config(settings)
    return settings


def _check_engine_config(settings: Settings) -> None:
    from lora_conformance.engines.registry import check_engine_config
    from lora_conformance.engines.base import EngineError

    try:
        check_engine_config(settings.engine, settings.engine_args, settings.sources.get("engine_arg", "command line"))
    except EngineError as exc:
        raise OptionError(str(exc)) from None


# ---- the same options on an argparse command line (lora-conformance certify) ------------------


def add_arguments(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (),
                  required: tuple[str, ...] = ()) -> None:
    """Every option but ``leave_out`` on ``parser``, as the plugin declares it. Nothing defaults
    here: what is not given is left to the plugin's own precedence (environment, ini, default)."""
    group = parser.add_argument_group(f"{GROUP} options (passed on to pytest; each also reads "
                                      f"{ENV_PREFIX}<NAME>)")
    for o in OPTIONS:
        if o.name in leave_out:
            continue
        default = isinstance(o.default, str) and o.name not in required
        shown = o.help.replace("%", "%%") + (f" (default: {o.default})" if default else "")
        if o.is_flag:
            group.add_argument(o.flag, action="store_true", dest=o.name, default=None, help=shown)
        elif o.multiple:
            group.add_argument(o.flag, action="append", dest=o.name, default=None, metavar="KEY=VALUE", help=shown)
        else:
            group.add_argument(o.flag, dest=o.name, default=None, choices=o.choices, required=o.name in required,
                               help=shown)


def as_pytest_arguments(namespace: argparse.Namespace) -> list[str]:
    """The options given on ``namespace`` (``add_arguments``' parser) as pytest arguments, in the
    table's order."""
    out: list[str] = []
    for o in OPTIONS:
        value = getattr(namespace, o.name, None)
        if not _given(value):
            continue
        if o.is_flag:
            out.append(o.flag)
        elif o.multiple:
            out += [f"{o.flag}={v}" for v in value]
        else:
            out.append(f"{o.flag}={value}")
    return out


def given_or_default(namespace: argparse.Namespace, name: str) -> Any:
    """``name``'s value as the plugin will resolve it from ``namespace``: the command line, else the
    environment, else the default (an ini key is not looked at: certify's run reads none)."""
    value = getattr(namespace, name, None)
    if _given(value):
        return value
    env = _from_environment(BY_NAME[name])
    return env[0] if env is not None else BY_NAME[name].default
