"""The device layer resolves devices and is the only place that names a device type."""

import re
from pathlib import Path

import pytest

from lora_conformance import devices

PKG = Path(__file__).resolve().parents[1] / "lora_conformance"
LAYER = "devices"  # the device layer: lora_conformance/devices/
DEVICE_LITERAL = re.compile(r"""torch\.(cuda|xpu)\b|["'](cuda|xpu)(:[0-9]+)?["']""")


def test_no_module_outside_the_device_layer_names_a_device_type():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).parts[0] == LAYER:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if DEVICE_LITERAL.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not offenders, "device names outside lora_conformance/devices/:\n" + "\n".join(offenders)


# The virtual accelerator is a device like any vendor's: only the device layer's plugin table and
# its own package may name it.
VDEV_LITERAL = re.compile(r"""["']vdev(:[0-9]+)?["']""")


def test_no_module_outside_the_device_layer_names_the_virtual_device():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).parts[0] in (LAYER, "vdev"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if VDEV_LITERAL.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not offenders, "the virtual device named outside the device layer:\n" + "\n".join(offenders)
    assert VDEV_LITERAL.search('x.to("vdev:0")') and not VDEV_LITERAL.search("vdev_tensor")


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


# ---- privateuse1, against a real one: the virtual accelerator (lora_conformance.vdev) --------


@pytest.fixture(scope="module")
def pu1():
    return devices.resolve_device("vdev")


def test_a_device_plugin_registers_on_request_and_resolves(pu1):
    import torch

    assert pu1 == "vdev:0"
    assert "vdev" in devices.device_plugins()
    assert devices.register_device_plugin("vdev") and not devices.register_device_plugin("nosuchdevice")
    assert torch._C._get_privateuse1_backend_name() == "vdev"
    assert devices.is_available("vdev") and devices.device_count("vdev") == 1
    assert devices.resolve_device("vdev", worker_index=5) == "vdev:0"  # gw5 on a one-device type
    with pytest.raises(devices.DeviceError, match="only 1"):
        devices.resolve_device("vdev:1")
    assert devices.default_dtype_for(pu1) == "bfloat16"
    assert "vdev" in devices.device_name(pu1) and devices.driver_version(pu1) == "n/a"


def test_a_failing_device_plugin_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(devices._BUILTIN_DEVICE_PLUGINS, "brokendev", "no_such_module_here:register")
    with pytest.raises(devices.DeviceError, match="brokendev.*failed to register"):
        devices.resolve_device("brokendev")


def test_privateuse1_streams_events_seeds_and_synchronize(pu1):
    import torch

    assert devices.supports_streams(pu1)
    side = devices.new_stream(pu1)
    event = devices.new_event(pu1)
    with devices.stream_context(pu1, side):
        x = torch.ones(4, device=pu1) * 2
        event.record(side)
    devices.wait_event(pu1, event)
    devices.current_stream(pu1).wait_stream(side)
    devices.synchronize(pu1)
    assert event.query() and x.cpu().tolist() == [2.0] * 4
    devices.manual_seed(123, pu1)
    a = torch.randn(3, device=pu1).cpu()
    devices.manual_seed(123, pu1)
    assert torch.equal(a, torch.randn(3, device=pu1).cpu())


def test_privateuse1_memory_figures_follow_live_tensors(pu1):
    import gc

    import torch

    gc.collect()
    devices.reset_peak_memory(pu1)
    base = devices.memory_stats(pu1)
    t = devices.zeros((1 << 16,), torch.float32, pu1)  # 256 KiB
    assert t.device == torch.device(pu1)
    held = devices.memory_stats(pu1)
    assert held.allocated - base.allocated == 1 << 18 and held.peak >= held.allocated
    del t
    gc.collect()
    assert devices.memory_stats(pu1).allocated == base.allocated
    devices.empty_cache(pu1)


def test_what_privateuse1_lacks_is_reported_not_crashed(pu1):
    assert not devices.pin_memory_supported(pu1)  # probed: no pinned-memory allocator
    assert devices.stream_trace(pu1) is None  # no trace hooks: the race detector says so
    assert not devices.graphs_supported(pu1) and not devices.triton_backend(pu1)
    with pytest.raises(devices.DeviceError, match="graph capture is not supported"):
        devices.new_graph(pu1)
    assert devices.needs_spawn(pu1)
