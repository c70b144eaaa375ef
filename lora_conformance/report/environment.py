"""The environment fingerprint of a run: what a certificate is a certificate of.

Called at session finish. Package versions come from installed metadata (no import); the
device name is asked of torch only when torch is already loaded or the device is an
accelerator, so a CPU run that never imported torch does not pay for it here.
"""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

PACKAGES = ("torch", "transformers", "peft", "pytest", "pytest-xdist")


def package_versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


MODIFIED = "+modified"


def git_commit(where: Path) -> Optional[str]:
    """The checkout's commit, with ``+modified`` where tracked files differ from it (a run of an
    uncommitted tree, or of files copied over an older checkout, must not name a commit it did not run)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5)
        if done.returncode != 0 or not done.stdout.strip():
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    head = done.stdout.strip()
    return head + MODIFIED if status.returncode == 0 and status.stdout.strip() else head


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str) -> dict[str, Optional[str]]:
    """Name and runtime of ``device``, as far as torch can tell; never raises."""
    dtype = device.split(":", 1)[0]
    info: dict[str, Optional[str]] = {"name": device, "type": dtype, "device_name": None, "runtime": None}
    if dtype == "cpu":
        info["device_name"] = _cpu_name()
        return info
    try:
        import torch

        backend = getattr(torch, dtype, None)
        if backend is not None and hasattr(backend, "get_device_name"):
            info["device_name"] = str(backend.get_device_name(torch.device(device)))
        runtime = getattr(torch.version, "hip", None) or getattr(torch.version, dtype, None)
        if runtime:
            info["runtime"] = f"{dtype} {runtime}"
    except Exception:  # a broken driver must not lose the report
        pass
    return info


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        elif value is not None:
            out[key] = value
    return out


def pytest_plugins(config: Any) -> dict[str, Any]:
    """The run's pytest plugins other than pytest's own, ours and conftest files (a plugin can
    rerun, reorder or reseed tests, so the report names them), and whether auto-loading was on."""
    import os

    names = set()
    for _, plugin in config.pluginmanager.list_name_plugin():
        mod = getattr(plugin, "__name__", None)
        if not isinstance(mod, str) or not hasattr(plugin, "__file__"):
            continue  # objects registered by pytest or by plugins, not plugin modules
        if mod.startswith(("_pytest.", "lora_conformance.")) or os.path.basename(plugin.__file__ or "") == "conftest.py":
            continue
        names.add(mod)
    from importlib import metadata

    try:
        owners = metadata.packages_distributions()
    except Exception:  # a broken installation must not lose the report
        owners = {}

    loaded_from = {getattr(mod, "__name__", ""): f"{dist.project_name} {dist.version}"
                   for mod, dist in config.pluginmanager.list_plugin_distinfo()}  # auto-loaded ones

    def named(module: str) -> str:
        if module in loaded_from:
            return loaded_from[module]
        dists = owners.get(module.split(".")[0]) or []
        if not dists:
            return module
        try:
            return f"{dists[0]} {metadata.version(dists[0])}"
        except metadata.PackageNotFoundError:
            return dists[0]

    off = bool(getattr(config.known_args_namespace, "disable_plugin_autoload", False)
               or os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"))
    return {"autoload": not off, "loaded": sorted({named(n) for n in names})}


def fingerprint(settings: Any, extra: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Environment from the resolved settings, overridden (deeply) by ``extra``: the dict the
    plugin leaves at ``config.stash[ENV_KEY]`` (engine version, device name, ...)."""
    import lora_conformance
    from lora_conformance.settings import repo_root

    device = getattr(settings, "device", None) or "unknown"
    env: dict[str, Any] = {
        "suite_version": lora_conformance.__version__,
        "engine": {
            "name": getattr(settings, "engine", None),
            "version": None,
            "args": dict(getattr(settings, "engine_args", {}) or {}),
        },
        "device": {"name": device, "type": device.split(":", 1)[0]},
        "dtype": getattr(settings, "dtype", None),
        "reference": {
            "device": getattr(settings, "reference_device", None),
            "dtype": getattr(settings, "reference_dtype", None),
        },
        "base_model": getattr(settings, "base_model", None),
        "base_quant": _base_quant(getattr(settings, "base_quant", "none")),
        "profile": _profile(settings),
        "packages": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(repo_root()) if repo_root() else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    extra = dict(extra or {})
    device_extra = extra.get("device") if isinstance(extra.get("device"), Mapping) else {}
    if "device_name" not in device_extra and ("torch" in sys.modules or not device.startswith("cpu")):
        env["device"] = _deep_merge(env["device"], device_info(device))
    elif device.startswith("cpu"):
        env["device"]["device_name"] = _cpu_name()
    return _deep_merge(env, extra)


def _base_quant(scheme: str) -> Optional[dict[str, str]]:
    """The base quantisation and how the reference was made (None: a float base)."""
    if scheme in (None, "none"):
        return None
    from lora_conformance.models import quant

    return {"scheme": scheme, "description": quant.SCHEMES[scheme], "reference": quant.REFERENCE_NOTE}
def _profile(settings: Any) -> Optional[dict]:
    """The certification profile: its ranks, adapter counts, prompt lengths and its models' shapes
    (models/profiles.py; the synthetic recipes' shape fields)."""
    name = getattr(settings, "profile", None)
    if name is None:
        return None
    from lora_conformance.models import profiles

    profile = profiles.get(name)
    shapes = {}
    for kind, spec in profile.models.items():
        shapes[kind] = profiles.model_shape(spec)
    return profile.describe(shapes)


def configuration(env: Mapping[str, Any], shown: Callable[[str, Any], str] = lambda key, value: str(value)) -> list[str]:
    """What besides engine, device and dtype changes what a run certifies, as a reader would say
    it: each engine arg (``key=value``), a quantised base (``base q8_0``), a base model other than
    the profile's own (``base_model synthetic:llama``) and a profile other than the fast one.
    ``shown(key, value)`` writes an arg's value (the README's table shortens a server command)."""
    out = [f"{k}={shown(k, v)}" for k, v in sorted(((env.get("engine") or {}).get("args") or {}).items())]
    quant = env.get("base_quant")
    if isinstance(quant, Mapping) and quant.get("scheme"):
        out.append(f"base {quant['scheme']}")
    profile = env.get("profile") if isinstance(env.get("profile"), Mapping) else {}
    decoder = (profile.get("models") or {}).get("decoder")
    if env.get("base_model") and decoder and env["base_model"] != decoder:
        out.append(f"base_model {env['base_model']}")
    if profile.get("name") not in (None, "fast"):
        out.append(f"profile {profile['name']}")
    return out


def column_key(env: Mapping[str, Any]) -> str:
    """``engine@device/dtype``, then its configuration where it has one (``[profile full]``): one
    column of a merged matrix. Runs of one engine in another mode, on another base or profile are
    other columns, never the shards of one."""
    engine = (env.get("engine") or {}).get("name") or "unknown"
    device = (env.get("device") or {}).get("type") or "unknown"
    conf = configuration(env)
    return f"{engine}@{device}/{env.get('dtype') or 'unknown'}" + (f" [{', '.join(conf)}]" if conf else "")
