"""Workers and threads: each pytest-xdist worker's torch thread share, and certify's worker count."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from lora_conformance import parallel
from lora_conformance import launch as certify

GiB = 1024**3


@pytest.fixture
def torch_threads():
    """Restore the process's torch thread count after a test run in this process changed it."""
    import torch

    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


# ---- the thread share -------------------------------------------------------------------


@pytest.mark.parametrize("cores,workers,expected", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 8, 2), (16, 3, 5), (1, 1, 1)])
def test_share_is_cores_over_workers_at_least_one(cores, workers, expected):
    share = parallel.thread_share(cores, workers, environ={})
    assert share.threads == expected, (cores, workers, share)
    assert f"{cores} cores // {workers}" in share.source


def test_user_omp_num_threads_is_left_to_torch():
    share = parallel.thread_share(16, 4, environ={"OMP_NUM_THREADS": "3"})
    assert share.threads is None
    assert share.describe() == "torch-threads=unchanged (OMP_NUM_THREADS=3 set by the user)"


def test_option_wins_over_omp_num_threads():
    share = parallel.thread_share(16, 4, option=6, option_source="environment LORA_CONFORMANCE_LORA_THREADS",
                                  environ={"OMP_NUM_THREADS": "3"})
    assert share.threads == 6
    assert "LORA_CONFORMANCE_LORA_THREADS" in share.source


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_bad_thread_option_is_refused(bad):
    with pytest.raises(ValueError, match="positive integer or auto"):
        parallel.parse_threads(bad)
    assert parallel.parse_threads("auto") is None and parallel.parse_threads(" 4 ") == 4


def test_apply_sets_torch_threads_and_leaves_a_user_choice(torch_threads):
    import torch

    target = 1 if torch_threads != 1 else 2
    parallel.apply_thread_share(parallel.ThreadShare(target, "test"))
    assert torch.get_num_threads() == target
    parallel.apply_thread_share(parallel.ThreadShare(None, "user"))
    assert torch.get_num_threads() == target


# ---- the plugin applies it (pytester) ---------------------------------------------------

THREADS_TEST = """
import torch

def test_threads(lora_harness):
    print("TORCH_THREADS", torch.get_num_threads())
    assert torch.get_num_threads() == {expected}, torch.get_num_threads()
"""


@pytest.fixture
def plugin_run(pytester, monkeypatch, tmp_path):
    for var in ("LORA_CONFORMANCE_LORA_THREADS", "OMP_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    return pytester


def test_a_nested_worker_run_gets_its_share(plugin_run, monkeypatch, torch_threads):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")  # as inside one of two xdist workers
    expected = max(1, parallel.cpu_cores() // 2)
    plugin_run.makepyfile(test_t=THREADS_TEST.format(expected=expected))
    result = plugin_run.runpytest("--device=cpu", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"lora-conformance: processes=2 torch-threads={expected} "
                                 f"({parallel.cpu_cores()} cores // 2 workers) per process"])


def test_lora_threads_option_is_applied_and_echoed(plugin_run, torch_threads):
    plugin_run.makepyfile(test_t=THREADS_TEST.format(expected=1))
    result = plugin_run.runpytest("--device=cpu", "--lora-threads=1", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["lora-conformance: processes=1 torch-threads=1 (--lora-threads from command line) "
                                 "per process"])


def test_bad_lora_threads_names_its_source(plugin_run, monkeypatch):
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_THREADS", "0")
    plugin_run.makepyfile(test_t="def test_ok(): pass")
    result = plugin_run.runpytest("--device=cpu", "-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--lora-threads='0' (from environment LORA_CONFORMANCE_LORA_THREADS): "
                                 "expected a positive integer or auto*"])


@pytest.mark.skipif(parallel.cpu_cores() < 2, reason="a share below torch's default needs at least 2 cores")
def test_xdist_workers_each_take_their_share(tmp_path):
    """Two xdist workers must not each keep torch's all-core thread pool (N workers x all cores)."""
    pytest.importorskip("xdist")
    (tmp_path / "test_t.py").write_text(textwrap.dedent(THREADS_TEST.format(expected=parallel.cpu_cores() // 2)))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LORA_CONFORMANCE_LORA_THREADS")}
    env["LORA_CONFORMANCE_LORA_CACHE"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-m", "pytest", "test_t.py", "-n", "2", "-p", "no:cacheprovider",
                          "--device=cpu", "-rA"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (f"processes=2 torch-threads={parallel.cpu_cores() // 2} ({parallel.cpu_cores()} cores // 2 workers)"
            in out.stdout), out.stdout[:2000]


# ---- certify's worker count -------------------------------------------------------------


@pytest.mark.parametrize("cores,memory,kind,devices,expected,binding", [
    (2, 20 * GiB, "cpu", 1, 2, "2 cores"),
    (16, 120 * GiB, "cpu", 1, 16, "16 cores"),
    (16, 9 * GiB, "cpu", 1, 4, "9 GiB available"),
    (16, 1 * GiB, "cpu", 1, 1, "1 GiB available"),
    (64, 500 * GiB, "cuda", 1, parallel.WORKERS_PER_DEVICE, "1 cuda device x"),
    (64, 500 * GiB, "cuda", 4, 4 * parallel.WORKERS_PER_DEVICE, "4 cuda devices x"),
    (16, 120 * GiB, "cuda", 4, 16, "16 cores"),
    (8, None, "cpu", 1, 8, "8 cores"),
])
def test_worker_choice_takes_the_tightest_limit(cores, memory, kind, devices, expected, binding):
    choice = parallel.choose_workers(cores, memory, kind, devices)
    assert choice.workers == expected, choice
    assert choice.reason.startswith(f"auto: {binding}"), choice.reason


def parse(*argv):
    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_auto_uses_the_machine(monkeypatch):
    monkeypatch.setattr(parallel, "cpu_cores", lambda: 6)
    monkeypatch.setattr(parallel, "available_memory", lambda: 64 * GiB)
    choice = parallel.workers_for_run("cpu", None)
    assert (choice.workers, choice.reason.split(";")[0]) == (6, "auto: 6 cores")


def test_certify_told_workers_and_pytest_workers():
    assert certify.worker_arguments(parse("--device", "cpu", "-n", "3"), xdist_installed=True)[0] == ["-n", "3"]
    assert certify.worker_arguments(parse("--device", "cpu"), xdist_installed=True)[0] == ["-n", "auto"]
    assert certify.worker_arguments(parse("--device", "cpu", "--", "-n", "4"), xdist_installed=True)[0] == []
    assert certify.worker_arguments(parse("--device", "cpu", "--", "--numprocesses=4"), xdist_installed=True)[0] == []
    assert certify.worker_arguments(parse("--device", "cpu", "-n", "1"), xdist_installed=True)[0] == []
    with pytest.raises(ValueError, match="give one"):
        certify.worker_arguments(parse("--device", "cpu", "-n", "2", "--", "-n4"), xdist_installed=True)
    with pytest.raises(ValueError, match="positive integer or auto"):
        certify.worker_arguments(parse("--device", "cpu", "-n", "0"), xdist_installed=True)


def test_certify_without_xdist_runs_in_one_process():
    workers, said = certify.worker_arguments(parse("--device", "cpu", "-n", "4"), xdist_installed=False)
    assert workers == [] and "pytest-xdist is not installed" in said


def test_certify_leaves_the_choice_to_the_plugins_hook(tmp_path, capsys):
    seen = []
    args = parse("--device", "cpu", "--report", str(tmp_path), "--", "-q")
    certify.run(args, runner=lambda cmd: seen.append(cmd) or 1)
    assert seen[0][-4:] == ["-n", "auto", f"--lora-report={tmp_path.resolve()}", "-q"], seen[0]
    assert "workers: auto: the plugin chooses" in capsys.readouterr().out


def test_certify_one_worker_runs_without_xdist(tmp_path):
    cmd = certify.pytest_command(parse("--device", "cpu", "--report", str(tmp_path)), workers=[])
    assert "-n" not in cmd, cmd


def test_pytest_n_auto_asks_the_plugin(pytester, monkeypatch):
    """``pytest -n auto`` with the plugin: pytest-xdist asks pytest_xdist_auto_num_workers, which
    chooses as certify's run does, and the header says so."""
    pytest.importorskip("xdist")
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(pytester.path / "cache"))
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "lora_conformance.plugin", "-p", "xdist", "-n", "auto",
                                           "--device=cpu", "-p", "no:cacheprovider")
    header = result.stdout.str()
    expected = parallel.workers_for_run("cpu", None).workers
    assert f"-n auto chose {expected} workers (auto: " in header, header
    result.assert_outcomes(passed=1)


def test_certify_refuses_a_bad_worker_count_before_running(tmp_path, capsys):
    ran = []
    assert certify.run(parse("--device", "cpu", "-n", "many", "--report", str(tmp_path)), runner=ran.append) == 2
    assert not ran and "-n/--workers 'many': expected a positive integer or auto" in capsys.readouterr().err


def test_auto_leaves_each_worker_enough_recorded_work():
    # 16 cores, 24 s of recorded tests: 8 workers of 3 s each (the H200 host certified fastest at 8)
    choice = parallel.choose_workers(16, 128 * GiB, "cpu", 1, recorded_work_s=24.0)
    assert choice.workers == 8 and choice.reason.startswith("auto: 24 s of tests in the last run / 3 s per worker")
    assert parallel.choose_workers(16, 128 * GiB, "cpu", 1, recorded_work_s=1.0).workers == 1
    assert parallel.choose_workers(2, 128 * GiB, "cpu", 1, recorded_work_s=24.0).workers == 2  # cores bind
    assert parallel.choose_workers(16, 128 * GiB, "cpu", 1, recorded_work_s=None).workers == 16  # nothing recorded
    assert parallel.choose_workers(16, 128 * GiB, "cuda", 1, recorded_work_s=600.0).workers == 8  # the device binds


def test_auto_reads_the_recorded_durations_of_the_run_s_own_tests(tmp_path):
    from lora_conformance import run_order

    durations = run_order.durations_path(tmp_path, "builtin", "cpu", "float32")
    durations.parent.mkdir(parents=True)
    (tmp_path / "suites").mkdir()
    # the run's tests count; other runs' tests (our own tests, also run under the plugin) do not
    durations.write_text('{"suites/test_accuracy.py::t1": 10.0, "suites/test_mixed_batch.py::t2[x]": 2.5,'
                         ' "tests/test_models.py::t3": 300.0}')
    assert run_order.recorded_work(durations, tmp_path, [tmp_path / "suites"]) == 12.5
    assert run_order.recorded_work(durations, tmp_path, []) == 312.5  # no path given: every test
    durations.write_text("{broken")
    assert run_order.recorded_work(durations, tmp_path, [tmp_path / "suites"]) is None


def test_auto_does_not_read_a_record_that_leaves_out_a_file_of_the_run(tmp_path):
    """After a narrow run (one file, or -k) the record holds a few seconds: a whole certification's
    other files are unknown, not free, so the record does not limit its workers."""
    from lora_conformance import run_order

    durations = run_order.durations_path(tmp_path, "builtin", "cpu", "float32")
    durations.parent.mkdir(parents=True)
    suites = tmp_path / "suites"
    suites.mkdir()
    for name in ("test_accuracy.py", "test_mixed_batch.py"):
        (suites / name).write_text("")
    durations.write_text('{"suites/test_accuracy.py::t1": 0.4}')
    assert run_order.recorded_work(durations, tmp_path, [suites]) is None
    assert run_order.recorded_work(durations, tmp_path, [suites / "test_accuracy.py"]) == 0.4
    durations.write_text('{"suites/test_accuracy.py::t1": 0.4, "suites/test_mixed_batch.py::t2": 1.0}')
    assert run_order.recorded_work(durations, tmp_path, [suites]) == 1.4


@pytest.mark.parametrize("env, cpus, expected", [
    ({}, [0, 1], [0, 1]),                                                          # no xdist: every CPU
    ({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2"}, [0, 1], [0]),
    ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, [0, 1], [1]),
    ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, [0, 1, 2, 3, 4], [2, 3, 4]),
    ({"PYTEST_XDIST_WORKER": "gw2", "PYTEST_XDIST_WORKER_COUNT": "3"}, [4, 5], [4]),  # more workers than CPUs
    ({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "1"}, [0, 1], [0, 1]),
])
def test_worker_cpus_are_disjoint_slices(env, cpus, expected):
    from lora_conformance.parallel import worker_cpus

    assert worker_cpus(env, cpus) == expected


@pytest.mark.parametrize("worker, ranks, expected", [("gw0", 1, "0"), ("gw1", 1, "1"), ("gw0", 2, "0|0")])
def test_vllm_engines_of_two_workers_are_pinned_to_their_own_cpus(monkeypatch, worker, ranks, expected):
    """vLLM's auto binding pins rank 0 of every engine to the first core: two workers' engines would
    share it. The plugin gives each worker's engines that worker's CPUs, unless the user set them."""
    from lora_conformance.engines.vllm_engine import VllmEngine

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    engine = VllmEngine.__new__(VllmEngine)
    engine._bind_threads(ranks)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == expected
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's
    engine._bind_threads(ranks)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


@pytest.mark.parametrize("engine, extra, dist", [
    ("builtin", [], None),                                  # cheap starts: xdist's load balancing
    ("vllm", [], ["--dist", "loadfile"]),                   # slow starts: a suite file's engines start once
    ("vllm", ["--", "--dist=load"], None),                  # the user's choice wins
])
def test_certify_keeps_suite_files_together_for_engines_that_start_slowly(tmp_path, engine, extra, dist):
    cmd = certify.pytest_command(parse("--device", "cpu", "--engine", engine, "--report", str(tmp_path), *extra),
                                 workers=["-n", "2"])
    assert cmd[cmd.index("-n"):cmd.index("-n") + 2] == ["-n", "2"]
    got = cmd[cmd.index("--dist"):cmd.index("--dist") + 2] if "--dist" in cmd else None
    assert got == dist, cmd


def test_the_full_profile_caps_workers_by_its_own_needs(monkeypatch):
    """The full profile's workers hold real-size bases: -n auto gives at most its workers per device
    and one per its host memory, and says the profile binds."""
    monkeypatch.setattr(parallel, "cpu_cores", lambda: 16)
    monkeypatch.setattr(parallel, "available_memory", lambda: 128 * GiB)
    from lora_conformance import devices

    monkeypatch.setattr(devices, "device_type", lambda device: "cuda")
    monkeypatch.setattr(devices, "device_count", lambda kind: 1)
    monkeypatch.setattr(devices, "total_memory", lambda device: None)  # not known: per-device cap only
    full = parallel.workers_for_run("cuda", None, "full")
    assert full.workers == 2 and "full profile" in full.reason
    assert parallel.workers_for_run("cuda", None, "fast").workers == 8
    monkeypatch.setattr(parallel, "available_memory", lambda: 40 * GiB)
    assert parallel.workers_for_run("cuda", None, "full").workers == 2
    monkeypatch.setattr(parallel, "available_memory", lambda: 20 * GiB)
    assert parallel.workers_for_run("cuda", None, "full").workers == 1


def test_the_full_profile_on_cpu_gives_a_worker_room_for_the_engine_too(monkeypatch):
    """On cpu a full-profile worker holds the engine's weights beside the reference's base and its
    adapted copy (7.1 GB each): one per cpu_worker_memory_gib of available memory, not per the
    accelerator's host figure."""
    from lora_conformance.models import profiles

    monkeypatch.setattr(parallel, "cpu_cores", lambda: 16)
    monkeypatch.setattr(parallel, "available_memory", lambda: 64 * GiB)
    full = profiles.get("full")
    assert full.cpu_worker_memory_gib > full.worker_memory_gib
    cpu = parallel.workers_for_run("cpu", None, "full")
    assert cpu.workers == int(64 // full.cpu_worker_memory_gib) == 2 and "full profile" in cpu.reason
    assert parallel.workers_for_run("cpu", None, "fast").workers == 16


def test_the_full_profile_fits_its_workers_into_the_device_memory(monkeypatch):
    """Two full-profile workers held 103.6 GB of one H200: -n auto gives an H200 two, an 80 GB card
    one and two such cards two, and names the device memory where it binds; the fast profile states
    no device need and is not asked for it."""
    from lora_conformance import devices

    monkeypatch.setattr(parallel, "cpu_cores", lambda: 16)
    monkeypatch.setattr(parallel, "available_memory", lambda: 128 * GiB)
    monkeypatch.setattr(devices, "device_type", lambda device: "cuda")
    count, asked = {"n": 1}, []
    monkeypatch.setattr(devices, "device_count", lambda kind: count["n"])
    sizes = {"h200": 139.8 * GiB, "h100": 79.2 * GiB}
    card = {"name": "h200"}

    def fake_memory(device):
        asked.append(device)
        return int(sizes[card["name"]])

    monkeypatch.setattr(devices, "total_memory", fake_memory)
    assert parallel.workers_for_run("cuda", None, "full").workers == 2
    assert asked == ["cuda:0"]
    card["name"] = "h100"
    one = parallel.workers_for_run("cuda", None, "full")
    assert one.workers == 1 and "per worker on the device (full profile)" in one.reason, one.reason
    count["n"] = 2
    assert parallel.workers_for_run("cuda", None, "full").workers == 2
    assert parallel.workers_for_run("cuda:1", None, "full").workers == 1 and asked[-1] == "cuda:1"
    asked.clear()
    assert parallel.workers_for_run("cuda", None, "fast").workers == 16
    assert asked == []


def test_the_host_has_no_device_memory_figure():
    """The device layer tells an accelerator's memory; the host's is available_memory's, not a card's."""
    from lora_conformance import devices

    assert devices.total_memory("cpu") is None


def test_forced_workers_past_the_device_memory_are_warned_of(monkeypatch):
    """-n N given (not auto) with more full-profile workers than the device memory holds: a warning
    naming the fit (two forced onto an 80 GB H100 ran out of memory cold); none where they fit, on
    cpu, for the fast profile (which states no device need) or where the size is unknown."""
    from lora_conformance import devices

    monkeypatch.setattr(devices, "device_type", lambda device: "cuda")
    count, size = {"n": 1}, {"b": int(79.2 * GiB)}
    monkeypatch.setattr(devices, "device_count", lambda kind: count["n"])
    monkeypatch.setattr(devices, "total_memory", lambda device: size["b"])
    warned = parallel.device_overcommit("cuda", "full", 2)
    assert warned and "-n 2" in warned and "1 cuda device of 79 GiB hold 1" in warned and "48 GiB" in warned
    assert parallel.device_overcommit("cuda", "full", 1) is None
    assert parallel.device_overcommit("cuda", "fast", 8) is None
    assert parallel.device_overcommit("cpu", "full", 4) is None
    count["n"] = 2
    assert parallel.device_overcommit("cuda", "full", 2) is None
    assert "hold 2" in parallel.device_overcommit("cuda", "full", 3)
    assert "1 cuda device of" in parallel.device_overcommit("cuda:1", "full", 2)
    size["b"] = int(139.8 * GiB)
    count["n"] = 1
    assert parallel.device_overcommit("cuda", "full", 2) is None
    size["b"] = None
    assert parallel.device_overcommit("cuda", "full", 4) is None


def test_the_plugin_warns_of_forced_workers_past_the_device_memory(plugin_run, monkeypatch):
    """pytest -n N: the controller asks device_overcommit once with the run's device, profile and N,
    and shows its sentence as a pytest warning (seen under -q, where the header is not). -n auto
    reaches it resolved too, never past the fit: the plugin's choice is bounded by the same memory."""
    pytest.importorskip("xdist")
    asked = []

    def overcommit(device, profile, workers):
        asked.append((device, profile, workers))
        return "-n 2: more workers than fit (a test's sentence)"

    monkeypatch.setattr(parallel, "device_overcommit", overcommit)
    plugin_run.makepyfile(test_t="def test_ok(): pass")
    result = plugin_run.runpytest("--device=cpu", "--profile=full", "-n", "2", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert asked == [("cpu", "full", 2)]
    result.stdout.fnmatch_lines(["*PytestConfigWarning: -n 2: more workers than fit (a test's sentence)*"])
