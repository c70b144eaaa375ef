"""vdev, the virtual privateuse1 accelerator: its kernels, its honesty, its faults, and the
built-in engine really running on it (tensors on vdev:0, not silently on the host)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lora_conformance import devices

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def vdev():
    from lora_conformance.vdev import faults

    name = devices.resolve_device("vdev")
    yield name
    faults.activate("")


@pytest.fixture
def fault(vdev):
    from lora_conformance import vdev as vdev_pkg
    from lora_conformance.vdev import faults, kernels

    def set_(name: str) -> None:
        vdev_pkg.register(fault=name)

    yield set_
    kernels.land_all()
    faults.activate("")


def test_importing_the_package_registers_nothing():
    code = ("import torch, lora_conformance.vdev, lora_conformance.plugin; "
            "print(torch._C._get_privateuse1_backend_name())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "privateuseone"


_REIMPORT = """
import gc, sys, torch
from lora_conformance import devices
devices.resolve_device("vdev")
first = torch.ones(3, device="vdev") * 2
for name in [n for n in sys.modules if n.startswith("lora_conformance")]:
    if name != "lora_conformance.vdev" or "all" in sys.argv:
        del sys.modules[name]  # what pytester does after an in-process run
gc.collect()
from lora_conformance import devices
devices.resolve_device("vdev")
from lora_conformance.vdev import faults
from lora_conformance.vdev.tensor import VdevTensor
second = torch.ones(3, device="vdev") * 3
import lora_conformance.vdev as again
again.register(fault="index_select_wraps")
print(isinstance(first, VdevTensor), isinstance(second, VdevTensor), (first + second).cpu().tolist(),
      faults.active(), again.is_registered())
"""


@pytest.mark.parametrize("dropped", ["all", "modules"])
def test_a_second_import_of_the_package_uses_the_registered_device(dropped):
    """pytester restores sys.modules after an in-process run: the next import of the package (all
    dropped) or of its modules (the package was imported before the run, its modules in it) is a
    second copy, and its tensors and fault switch must still be the device's (it once recursed)."""
    run = subprocess.run([sys.executable, "-c", _REIMPORT, dropped], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "[5.0,", "5.0,", "5.0]", "index_select_wraps", "True"]


def test_an_unknown_fault_is_refused_with_the_catalogue(vdev):
    from lora_conformance import vdev as vdev_pkg
    from lora_conformance.vdev.faults import UnknownFaultError

    with pytest.raises(UnknownFaultError, match="bf16_matmul_accumulate"):
        vdev_pkg.register(fault="bogus")
    vdev_pkg.register(fault="")


def test_operations_run_on_the_device_and_results_come_back_as_host_tensors(vdev):
    from lora_conformance.vdev.tensor import VdevTensor

    a = torch.randn(5, 7)
    b = torch.randn(7, 3)
    c = a.to(vdev) @ b.to(vdev)
    assert isinstance(c, VdevTensor) and c.device == torch.device(vdev)
    back = c.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    torch.testing.assert_close(back, a @ b)
    assert torch.arange(6, device=vdev).shape == (6,)  # an out= kernel resizing its output
    assert torch.tensor([3, 4], device=vdev).tolist() == [3, 4]


def test_device_and_host_memory_never_alias(vdev):
    host = torch.zeros(4)
    dev = host.to(vdev)
    dev.add_(1)
    assert host.tolist() == [0.0] * 4  # the upload copied
    back = dev.cpu()
    back.add_(1)
    assert dev.tolist() == [1.0] * 4  # and so did the download
    view = dev[1:3]
    view.fill_(5)
    assert dev.tolist() == [1.0, 5.0, 5.0, 1.0]  # a view of a device tensor aliases it


def test_mixing_device_and_host_tensors_is_refused_as_on_a_real_device(vdev):
    x = torch.ones(3, device=vdev)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(3)
    assert (x + torch.tensor(2.0)).tolist() == [3.0] * 3  # a 0-dim host scalar is fine


def test_parameter_data_swaps_carry_the_values(vdev):
    lin = torch.nn.Linear(4, 2).to(vdev)
    w = lin.weight.detach().cpu()
    lin.weight.data = lin.weight.data.to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16
    torch.testing.assert_close(lin.weight.detach().cpu(), w.to(torch.bfloat16))


def test_memory_statistics_count_live_device_tensors(vdev):
    import gc

    gc.collect()
    devices.reset_peak_memory(vdev)
    before = devices.memory_stats(vdev).allocated
    x = torch.empty(1 << 18, device=vdev)  # 1 MiB
    held = devices.memory_stats(vdev)
    assert held.allocated - before == 1 << 20 and held.peak >= held.allocated
    y = x[10:20]  # a view holds no new memory
    assert devices.memory_stats(vdev).allocated == held.allocated
    del x, y
    gc.collect()
    after = devices.memory_stats(vdev)
    assert after.allocated == before and after.peak == held.peak


def test_faults_change_what_their_kernel_computes(fault, vdev):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 256, generator=g).bfloat16()
    b = torch.randn(256, 8, generator=g).bfloat16()
    good = (a.to(vdev) @ b.to(vdev)).cpu()
    fault("bf16_matmul_accumulate")
    bad = (a.to(vdev) @ b.to(vdev)).cpu()
    assert not torch.equal(good, bad)
    exact = a.double() @ b.double()
    assert (bad.double() - exact).abs().mean() > 2 * (good.double() - exact).abs().mean()

    fault("index_select_wraps")
    w = torch.arange(600.0).unsqueeze(1).to(vdev)
    assert torch.nn.functional.embedding(torch.tensor([3, 511, 512, 599], device=vdev), w).cpu().flatten().tolist() \
        == [3.0, 511.0, 0.0, 87.0]

    fault("reduction_drops_tail")
    x = torch.ones(6, 10, device=vdev)
    assert x.sum(-1).tolist() == [10.0] * 4 + [0.0] * 2  # rows 4 and 5: the partial block
    assert x.sum(0).tolist() == [6.0] * 10  # not a row-wise reduction over the last dimension

    fault("async_h2d_copy")
    slot = torch.zeros(4, device=vdev)
    slot.copy_(torch.full((4,), 7.0))
    assert (slot * 1).tolist() == [0.0] * 4  # the first use reads the old contents
    assert slot.tolist() == [7.0] * 4  # then the copy has landed
    slot.copy_(torch.full((4,), 9.0))
    devices.synchronize(vdev)  # a synchronisation completes every copy in flight
    assert (slot * 1).tolist() == [9.0] * 4
    pool = torch.zeros(2, 3, device=vdev)
    pool[0].copy_(torch.ones(3))
    pool[1].copy_(torch.full((3,), 2.0))
    other = torch.zeros(3, device=vdev)
    other.copy_(torch.ones(3))
    assert pool.sum().item() == 0.0  # both slots of the pool read stale; both land after that read
    assert pool.sum().item() == 9.0 and (other * 1).tolist() == [0.0] * 3


def test_the_builtin_engine_really_runs_on_vdev(vdev, tmp_path):
    """Every parameter and KV cache lives on vdev:0, the device's memory holds the weights, and
    float32 answers equal the host's (same kernels: any difference is a device-layer bug)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _builtin_models import build_adapter, build_decoder

    from lora_conformance.engines.builtin import BuiltinEngine
    from lora_conformance.types import GenerationRequest
    from lora_conformance.vdev.tensor import VdevTensor

    base = build_decoder(tmp_path / "base")
    adapter = build_adapter(base, tmp_path / "a1", 1)
    reqs = [GenerationRequest("the cat sat on the mat", "a1", max_new_tokens=4, top_k=3),
            GenerationRequest("a dog ran fast", None, max_new_tokens=4, top_k=3)]
    out = {}
    for dev in ("cpu", vdev):
        with BuiltinEngine(base, dev, "float32", {}) as eng:
            eng.load_adapter("a1", adapter)
            if dev != "cpu":
                params = list(eng.model.parameters())
                assert params and all(isinstance(p, VdevTensor) for p in params)
                assert all(isinstance(k, VdevTensor) for k in eng.model.kv_caches)
                weights = sum(p.numel() * p.element_size() for p in params)
                assert devices.memory_stats(dev).allocated >= weights
            out[dev] = eng.generate(reqs)
    assert [r.token_ids for r in out["cpu"]] == [r.token_ids for r in out[vdev]]


def test_the_report_says_what_each_process_and_each_case_held_on_the_device(pytester):
    """Each test's teardown carries its process's device memory peaks (torch's allocator): the report
    gives the largest process's, what a worker needs, and their sum; a cpu run has no such figures.
    The allocator's peaks are reset after every test: each record says what its process held while
    that test ran, its shared engine included (a test after a large one is not charged the large
    one's peak), the process's peak stays the largest over its tests, and the report names the case
    that held the most."""
    pytester.makepyfile(
        "import torch\n"
        "def test_large(lora, device):\n"
        "    engine = lora.engine\n"
        "    big = torch.zeros(256 << 20, dtype=torch.uint8, device=device)  # 256 MiB at once\n"
        "    del big\n"
        "def test_small(lora):\n"
        "    lora.engine.generate(lora.requests([None]))\n")
    result = pytester.runpytest_subprocess("--device=vdev", "--dtype=bfloat16", "--lora-report=out",
                                           "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    memory = report["environment"]["device_memory"]
    assert memory["processes"] == 1 and memory["largest_peak_allocated"] > 1 << 20  # the engine's weights at least
    assert memory["summed_peak_reserved"] == memory["largest_peak_reserved"] >= memory["largest_peak_allocated"]
    result.stdout.fnmatch_lines(["device memory: * GiB reserved (* GiB in tensors) by the largest of 1 process; *"])
    assert "| device memory |" in (pytester.path / "out" / "report.md").read_text()
    peak = {r["nodeid"].split("::")[-1].split("[")[0]: r["device_peak"] for r in report["records"]}
    assert peak["test_large"] >= 256 << 20 and 0 < peak["test_small"] < peak["test_large"] - (128 << 20), peak
    assert memory["largest_case"].split("::")[-1].startswith("test_large")
    assert memory["largest_case_peak_allocated"] == peak["test_large"] <= memory["largest_peak_allocated"]
    result.stdout.fnmatch_lines(["device memory: * the most one case held: * GiB in tensors (*test_large*)"])
    result = pytester.runpytest_subprocess("--device=cpu", "--lora-report=cpu", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "cpu" / "report.json").read_text())
    assert "device_memory" not in report["environment"]
    assert all(r["device_peak"] is None for r in report["records"])
    assert "device memory:" not in result.stdout.str()
