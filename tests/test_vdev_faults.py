"""Each device fault of vdev is caught by the certification, and the report names the fault.

The built-in engine is the same code on the correct and the faulty device, so a failure here is
the suites catching the device. Each fault runs one suite file (the mixed-batch one: prefill and
decode, several adapters in their slots, every token id of the vocabulary) and stops at its first
failure (-x), which keeps the test to a few engine runs. The file is not hand-picked per fault:
the same file for every fault, and the correct device passes it (the control below). The correct
device passing the whole certification is ``lora-conformance certify --device vdev`` (reports/ and
the CI lane).
"""

from __future__ import annotations

import json

import pytest

from lora_conformance.settings import suites_dir
from lora_conformance.vdev.faults import FAULTS


@pytest.fixture
def faulty_vdev(monkeypatch):
    from lora_conformance.vdev import faults, kernels

    def use(name: str) -> None:
        monkeypatch.setenv("LORA_VDEV_FAULT", name)

    yield use
    kernels.land_all()
    faults.activate("")  # the inner run registered the fault in this process


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_certification_catches_the_device_fault(suite_runner, lora_settings, faulty_vdev, tmp_path, fault):
    faulty_vdev(fault)
    report = tmp_path / "report"
    result = suite_runner.runpytest(str(suites_dir() / "test_mixed_batch.py"), "--device=vdev", "--engine=builtin",
                                    f"--lora-cache={lora_settings.cache_dir}", f"--lora-report={report}",
                                    "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-x")
    failed = [r.nodeid for r in result.reprec.getreports("pytest_runtest_logreport") if r.failed]
    assert failed, f"vdev fault {fault} was not caught:\n" + "\n".join(result.outlines[-30:])
    data = json.loads((report / "report.json").read_text())
    assert fault in json.dumps(data["environment"]), "the report does not name the device fault (the device's name carries it)"
    verdict = data["verdict"]
    assert verdict["summary"]["certified"] is False
    failing = [f["id"] for f in verdict["features"].values() if f["status"] in ("failed", "error")]
    assert failing, "the report names no failing feature"


@pytest.mark.slow
def test_the_correct_device_passes_the_same_suite(suite_runner, lora_settings, faulty_vdev, tmp_path):
    """The control for the test above (the failures are the faults'), and the per-commit check that
    the device layer still runs the built-in engine on a privateuse1 device. The whole
    certification on vdev takes minutes (every operation crosses into Python), so the test suite
    runs this file; ci/workflows/vdev.yml runs the per-commit files and reports/ the full run."""
    faulty_vdev("")
    from lora_conformance.vdev import tensor

    before = tensor.memory().peak
    result = suite_runner.runpytest(str(suites_dir() / "test_mixed_batch.py"), "--device=vdev", "--engine=builtin",
                                    f"--lora-cache={lora_settings.cache_dir}", "-p", "no:cacheprovider",
                                    "-p", "no:xdist", "-q")
    reports = result.reprec.getreports("pytest_runtest_logreport")
    failed = [r.nodeid for r in reports if r.failed]
    assert not failed, "the correct vdev fails:\n" + "\n".join(result.outlines[-30:])
    passed = [r for r in reports if r.when == "call" and r.passed]
    assert len(passed) >= 10 and all("[vdev-" in r.nodeid for r in passed)
    assert tensor.memory().peak > before  # the engine's weights and caches were held by the device
