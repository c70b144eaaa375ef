"""The device layer resolves devices and is the only module that names a device type."""

import re
from pathlib import Path

import pytest

from lora_conformance import devices

PKG = Path(__file__).resolve().parents[1] / "lora_conformance"
DEVICE_LITERAL = re.compile(r"""torch\.(cuda|xpu)\b|["'](cuda|xpu)(:[0-9]+)?["']""")


def test_no_module_outside_the_device_layer_names_a_device_type():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "devices.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if DEVICE_LITERAL.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not offenders, "device names outside lora_conformance/devices.py:\n" + "\n".join(offenders)


def test_the_literal_check_itself_catches_what_it_should():
    for bad in ('torch.cuda.synchronize()', 'x.to("cuda")', "dev = 'xpu:1'", "torch.xpu.Stream()"):
        assert DEVICE_LITERAL.search(bad), bad
    assert not DEVICE_LITERAL.search("devices.synchronize(device)")


def test_cpu_resolution_and_defaults():
    assert devices.resolve_device("cpu") == "cpu"
    assert devices.resolve_device("cpu", worker_index=7) == "cpu"
    assert devices.resolve_device("auto") in ("cpu",) or ":" in devices.resolve_device("auto")
    assert devices.default_dtype_for("cpu") == "float32"
    assert devices.default_dtype_for("xpu:0") == "bfloat16"


def test_bad_device_strings_are_refused_clearly():
    with pytest.raises(devices.DeviceError, match="not a torch device"):
        devices.resolve_device("tpu9")


def test_xdist_worker_index_spreads_over_devices(monkeypatch):
    monkeypatch.setattr(devices, "is_available", lambda t: t in ("cpu", "cuda"))
    monkeypatch.setattr(devices, "device_count", lambda t: 4 if t == "cuda" else 1)
    assert devices.resolve_device("cuda", worker_index=0) == "cuda:0"
    assert devices.resolve_device("cuda", worker_index=5) == "cuda:1"
    assert devices.resolve_device("cuda:2", worker_index=5) == "cuda:2"
    with pytest.raises(devices.DeviceError, match="only 4"):
        devices.resolve_device("cuda:7")


def test_unavailable_accelerator_is_refused():
    import torch

    if torch.cuda.is_available():  # noqa: the test module is outside the package
        pytest.skip("not applicable: this machine has CUDA")
    with pytest.raises(devices.DeviceError, match="not available"):
        devices.resolve_device("cuda")


def test_cpu_streams_events_and_memory_are_safe_no_ops():
    s = devices.new_stream("cpu")
    e = devices.new_event("cpu")
    with devices.stream_context("cpu", s):
        e.record(s)
    devices.wait_event("cpu", e)
    devices.synchronize("cpu")
    assert devices.memory_stats("cpu").peak == 0
    assert not devices.graphs_supported("cpu")
    with pytest.raises(devices.DeviceError):
        devices.new_graph("cpu")
    assert not devices.needs_spawn("cpu") and devices.needs_spawn("xpu:0")


def test_missing_ipex_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "intel_extension_for_pytorch":
            raise ImportError("No module named 'intel_extension_for_pytorch'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    assert devices.maybe_import_ipex() is False
    with pytest.raises(devices.DeviceError, match="xpu"):
        devices.maybe_import_ipex(required=True)
