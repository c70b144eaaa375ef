"""The pytest plugin, run through pytester: options, precedence, usage errors, markers, ids, gating, evidence."""

import json
import subprocess
import sys

import pytest

FAKE_ENGINE = '''
from lora_conformance.engines.base import Capability, Engine, Limits
from lora_conformance.types import GenerationResult


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, args)
        self.capabilities = frozenset({Capability.MIXED_BATCH})
        self.limits = Limits(2, 4, 16)
        self._loaded = {}

    def load_adapter(self, name, path, pinned=False):
        self._loaded[name] = path

    def unload_adapter(self, name):
        self._loaded.pop(name)

    def list_adapters(self):
        return list(self._loaded)

    def generate(self, requests):
        return [GenerationResult([1], "x") for _ in requests]
'''


@pytest.fixture
def fake(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(fake_engine=FAKE_ENGINE)
    pytester.syspathinsert()
    for var in ("LORA_CONFORMANCE_DEVICE", "LORA_CONFORMANCE_DTYPE", "LORA_CONFORMANCE_ENGINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    return pytester


def test_help_imports_no_torch(tmp_path):
    code = "import sys, pytest; pytest.main(['--help', '-q']); print('TORCH' if 'torch' in sys.modules else 'CLEAN')"
    # From a neutral directory: only the plugin is loaded, not this repository's own conftest files.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "--device" in out.stdout and "--engine-arg" in out.stdout
    assert out.stdout.strip().endswith("CLEAN"), out.stdout[-300:]


def test_header_echoes_settings_and_versions(fake):
    fake.makepyfile(test_x="def test_ok(): pass")
    result = fake.runpytest("--device=cpu", "--engine=fake_engine:FakeEngine", "--engine-arg", "a=1")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "lora-conformance: engine=fake_engine:FakeEngine device=cpu (*) dtype=float32 base-model=synthetic:llama",
        "*engine-args={\"a\": \"1\"}*",
        "lora-conformance: torch=* transformers=* peft=*",
    ])


def test_precedence_command_line_then_environment_then_ini(fake, monkeypatch):
    fake.makeini("[pytest]\ndtype = float16\nengine = builtin\n")
    fake.makepyfile(test_x="""
def test_settings(lora_settings):
    print("DTYPE", lora_settings.dtype, lora_settings.sources["dtype"])
    print("ENGINE", lora_settings.engine, lora_settings.sources["engine"])
""")
    monkeypatch.setenv("LORA_CONFORMANCE_DTYPE", "bfloat16")
    result = fake.runpytest("-s", "--engine=peft")
    result.stdout.fnmatch_lines(["*DTYPE bfloat16 environment LORA_CONFORMANCE_DTYPE", "ENGINE peft command line"])
    monkeypatch.delenv("LORA_CONFORMANCE_DTYPE")
    result = fake.runpytest("-s")
    result.stdout.fnmatch_lines(["*DTYPE float16 ini key dtype", "ENGINE builtin ini key engine"])


@pytest.mark.parametrize("args, env, expected", [
    (["--device=tpu9"], {}, "--device='tpu9' (from command line): *not a torch device*accepted: cpu, cuda*"),
    (["--dtype=int8"], {}, "--dtype='int8' (from command line): expected one of float32, bfloat16, float16"),
    ([], {"LORA_CONFORMANCE_DTYPE": "fp8"}, "--dtype='fp8' (from environment LORA_CONFORMANCE_DTYPE): expected one of*"),
    (["--engine=nope"], {}, "--engine='nope' (from command line): expected one of *builtin*"),
    (["--engine-arg", "novalue"], {}, "*--engine-arg*(from command line): engine argument 'novalue' is not KEY=VALUE"),
    (["--base-model=synthetic:gpt"], {}, "--base-model='synthetic:gpt' (from command line): expected synthetic:llama*"),
    (["--base-model=/nonexistent/dir"], {}, "*no config.json in that directory*"),
    ([], {"LORA_CONFORMANCE_LORA_REFRESH_REFERENCES": "maybe"}, "*LORA_CONFORMANCE_LORA_REFRESH_REFERENCES='maybe' (environment)*"),
])
def test_bad_values_are_usage_errors(fake, monkeypatch, args, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake.makepyfile(test_x="def test_ok(): pass")
    result = fake.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{expected}"])


def test_markers_ids_device_skips_and_capability_gate(fake):
    fake.makepyfile(test_x="""
import pytest

def test_ids(device, dtype):
    assert device == "cpu" and dtype == "float32"

@pytest.mark.cuda
def test_cuda_only():
    raise AssertionError("must not run on cpu")

@pytest.mark.device("cpu", "xpu")
def test_cpu_or_xpu():
    pass

@pytest.mark.requires("pinning")
def test_needs_pinning(device, dtype):
    raise AssertionError("must be gated")

@pytest.mark.requires("mixed_batch")
def test_needs_mixed(device, dtype):
    pass

@pytest.mark.slow
def test_slow():
    pass
""")
    # The fake engine never reads weights: a directory with a config.json is a valid local model.
    model = fake.mkdir("model")
    (model / "config.json").write_text("{}")
    result = fake.runpytest("--strict-markers", "--engine=fake_engine:FakeEngine", f"--base-model={model}", "-rs", "-v")
    result.assert_outcomes(passed=4, skipped=2)
    for line in ("*test_ids[[]cpu-float32[]] PASSED*", "*not applicable: test is for cuda, running on cpu*",
                 "*not certified: engine does not declare pinning*"):
        result.stdout.fnmatch_lines([line])


def test_unknown_capability_is_a_collection_error(fake):
    fake.makepyfile(test_x="""
import pytest

@pytest.mark.requires("teleport")
def test_x():
    pass
""")
    result = fake.runpytest("--engine=fake_engine:FakeEngine")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x*unknown engine capability 'teleport'*"])


def test_comparison_evidence_reaches_the_report(fake):
    fake.makeconftest("""
def pytest_runtest_logreport(report):
    if report.when == "call":
        for k, v in report.user_properties:
            if k == "lora_evidence":
                print("EVIDENCE", v)
""")
    fake.makepyfile(test_x="""
from lora_conformance.judge import assert_rouge_l

def test_bad():
    assert_rouge_l("a b c", "x y z", 0.9, label="demo")
""")
    result = fake.runpytest("-s")
    result.assert_outcomes(failed=1)
    line = next(l for l in result.outlines if "EVIDENCE " in l)
    evidence = json.loads(line.split("EVIDENCE ", 1)[1])
    assert evidence["check"] == "rouge_l" and evidence["label"] == "demo" and evidence["score"] == 0.0


def test_only_the_processs_own_run_freezes_objects(pytester):
    """gc.freeze moves objects out of the collector for good: a pytest run inside a test (pytester)
    must not freeze its session, which is garbage once it ends."""
    import gc

    pytester.makepyfile(test_tiny="def test_a():\n    pass\n")
    before = gc.get_freeze_count()
    result = pytester.inline_run("--device=cpu", "-p", "no:cacheprovider")  # the plugin: PYTEST_PLUGINS (conftest)
    result.assertoutcome(passed=1)
    assert gc.get_freeze_count() <= before  # frozen objects that die leave the count; only a freeze adds
