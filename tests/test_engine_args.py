"""Engine configuration as data: declared arguments, one parser, start-up checks, declared capabilities.

Every engine of ours declares its arguments once (engines/args.py); a bad one fails before any
test in one line; a missing optional dependency names the extra to install; the capabilities a
class declares without starting equal what a started engine reports (vLLM, SGLang and served
engines through their stand-ins).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import types
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lora_conformance.engines.args import (  # noqa: E402
    STANDARD_ARGS,
    EngineArgError,
    MissingDependencyError,
    arg,
    arg_specs,
    check_dependencies,
    class_capabilities,
)
from lora_conformance.engines.base import Capability, Engine, UnsupportedFeatureError  # noqa: E402
from lora_conformance.engines.registry import _BUILTIN, check_engine_config, engine_class  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OURS = sorted(_BUILTIN)


# ---- declarations ------------------------------------------------------------------------


@pytest.mark.parametrize("name", OURS)
def test_every_engine_declares_its_arguments(name):
    cls = engine_class(name)
    assert cls.Args is not None, f"{name}: no argument declaration"
    specs = arg_specs(cls.Args)
    assert specs, name
    for s in specs:
        assert s.help.strip(), f"{name}: {s.name} has no meaning"
        assert s.type in (int, float, bool, str), (name, s)
    defaults = cls.parse_args({})
    assert {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)} == {s.name: s.default for s in specs}
    for key in cls.standard_args:
        assert key in STANDARD_ARGS, f"{name} maps {key!r}, which is not a standard arg"


@pytest.mark.parametrize("name", OURS)
def test_a_typo_is_one_line_with_did_you_mean(name):
    cls = engine_class(name)
    takes = "max_loras_per_batch" in cls.standard_args or any(s.name == "max_loras_per_batch"
                                                              for s in arg_specs(cls.Args))
    with pytest.raises(EngineArgError) as exc:
        cls.parse_args({"max_loras_per_bach": "2"}, "command line")
    msg = str(exc.value)
    assert "\n" not in msg and "'max_loras_per_bach'" in msg and "(from command line)" in msg, msg
    if takes:
        assert "did you mean max_loras_per_batch?" in msg, msg


def test_bad_values_name_the_arg_the_value_the_source_and_what_was_expected():
    cls = engine_class("builtin")
    cases = {
        ("max_rank", "x"): "engine arg max_rank='x': expected an integer >= 1 (from environment LORA_X)",
        ("prefix_cache", "maybe"): "engine arg prefix_cache='maybe': expected a boolean",
        ("eviction", "random"): "engine arg eviction='random': expected lru or fifo",
        ("kernels", "fast"): "engine arg kernels='fast': expected one of auto, torch, triton",
        ("chunked_prefill_size", "-1"): "expected an integer >= 0",
    }
    for (key, value), expected in cases.items():
        with pytest.raises(EngineArgError) as exc:
            cls.parse_args({key: value}, {key: "environment LORA_X"})
        assert expected in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    # a value checked by the engine's own catalogue keeps its message, on one line
    with pytest.raises(EngineArgError, match="fault='nope': unknown fault 'nope'; the catalogue: .*delta_twice"):
        cls.parse_args({"fault": "nope"})
    # cross-field rules in __post_init__, with where the values came from
    with pytest.raises(EngineArgError, match="max_loaded_loras=2 must be >= max_loras_per_batch=4.*from ini key"):
        cls.parse_args({"max_loaded_loras": "2"}, "ini key engine_arg")


def test_standard_args_are_typed_once_and_mapped_per_engine():
    vllm = engine_class("vllm")
    cfg = vllm.parse_args({"max_loras_per_batch": "2", "max_loaded_loras": "5", "graphs": "true",
                           "tensor_parallel": "2"})
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.enforce_eager, cfg.tensor_parallel_size) == (2, 5, False, 2)
    # an own arg given explicitly wins over the standard one
    assert vllm.parse_args({"max_loras_per_batch": "2", "max_loras": "3"}).max_loras == 3
    # the standard arg's type is checked before the mapping, whatever the engine
    for name in ("vllm", "sglang", "openai", "builtin"):
        with pytest.raises(EngineArgError, match="max_loras_per_batch='two': expected an integer >= 1"):
            engine_class(name).parse_args({"max_loras_per_batch": "two"})
    # SGLang counts the base model as a slot
    assert engine_class("sglang").parse_args({"max_loras_per_batch": "3"}).max_loras_per_batch == 4
    # a value the engine cannot honour is a refusal, not a typo
    with pytest.raises(UnsupportedFeatureError, match="only eviction=lru"):
        vllm.parse_args({"eviction": "fifo"})
    # a standard arg the engine does not take at all is unknown to it, and says so
    with pytest.raises(EngineArgError, match="'max_loras_per_batch' \\(a standard arg this engine does not take\\)"):
        engine_class("peft").parse_args({"max_loras_per_batch": "2"})


def test_an_engine_without_a_declaration_takes_its_args_unchecked():
    class Plain(Engine):
        name = "plain"

        def load_adapter(self, name, path, pinned=False): ...
        def unload_adapter(self, name): ...
        def list_adapters(self): return []
        def generate(self, requests): return []

    assert Plain.parse_args({"anything": "1"}) == {"anything": "1"}
    assert Plain.declared_capabilities({}, None, "cpu") is None


# ---- start-up checks -----------------------------------------------------------------------


def test_missing_dependency_is_one_line_naming_the_extra():
    class NeedsIt(Engine):
        name = "needs-it"
        requires = ("no_such_module_for_lora_conformance",)
        extra = "something"

    with pytest.raises(MissingDependencyError) as exc:
        check_dependencies(NeedsIt)
    assert str(exc.value) == ("engine 'needs-it' needs no_such_module_for_lora_conformance, which is not installed "
                              "here: pip install 'lora-conformance[something]'")


@pytest.mark.parametrize("name, extra", [("vllm", "vllm"), ("sglang", "sglang")])
def test_missing_engine_library_found_without_importing_it(name, extra):
    try:
        import importlib.util

        if importlib.util.find_spec(name) is not None:
            pytest.skip(f"{name} is installed here")
    except ValueError:
        pytest.skip(f"{name} is a stand-in module here")
    with pytest.raises(MissingDependencyError, match=rf"pip install 'lora-conformance\[{extra}\]'$"):
        check_engine_config(name, {}, "command line")
    assert name not in sys.modules


def test_check_engine_config_passes_a_good_configuration():
    check_engine_config("builtin", {"max_loras_per_batch": "2", "prefix_cache": "off"}, "command line")
    check_engine_config("openai", {"url": "http://127.0.0.1:1"}, "command line")


def _run(*args, env=None):
    """This checkout's CLI or pytest in a fresh process, without the caller's LORA_CONFORMANCE_* settings."""
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("LORA_CONFORMANCE_")}
    full.update(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=full)


def test_pytest_fails_at_start_up_in_one_line_and_writes_no_report(tmp_path):
    report = tmp_path / "report"
    out = _run("-m", "pytest", "suites", "-p", "no:xdist", "-p", "no:cacheprovider", "--engine-arg",
               "max_loras_per_bach=2", f"--lora-report={report}", f"--lora-cache={tmp_path / 'cache'}")
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith("ERROR: engine 'builtin': unknown engine argument 'max_loras_per_bach' (from command "
                                "line); did you mean max_loras_per_batch?"), errors
    assert not report.exists()


def test_bad_value_from_the_environment_says_so(tmp_path):
    out = _run("-m", "pytest", "suites", "-p", "no:xdist", "-p", "no:cacheprovider",
               f"--lora-cache={tmp_path / 'cache'}", env={"LORA_CONFORMANCE_ENGINE_ARG": "max_rank=big"})
    assert out.returncode == pytest.ExitCode.USAGE_ERROR
    assert ("ERROR: engine 'builtin': engine arg max_rank='big': expected an integer >= 1 (from environment "
            "LORA_CONFORMANCE_ENGINE_ARG)") in out.stderr, out.stderr[-2000:]


def test_certify_fails_before_any_test_and_writes_no_report(tmp_path):
    report = tmp_path / "report"
    out = _run("-m", "lora_conformance.cli", "certify", "--device", "cpu", "--engine-arg", "max_loras_per_bach=2",
               "--report", str(report), "--", f"--lora-cache={tmp_path / 'cache'}")
    assert out.returncode != 0
    assert "did you mean max_loras_per_batch?" in out.stderr, out.stderr[-2000:]
    assert "no report was written" in out.stderr and not (report / "report.json").exists()
    assert "passed" not in out.stdout and "Traceback" not in out.stdout + out.stderr


# ---- the engines command -------------------------------------------------------------------


def test_engines_lists_every_engine_with_its_availability():
    out = _run("-m", "lora_conformance.cli", "engines")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:] if line.strip()
            and not line.startswith("`")}
    assert set(OURS) <= set(rows), rows
    assert rows["builtin"] == rows["openai"] == "yes"
    import importlib.util

    for name in ("vllm", "sglang"):
        assert rows[name] == ("yes" if importlib.util.find_spec(name) else "no")
        if rows[name] == "no":
            assert f"pip install 'lora-conformance[{name}]'" in out.stdout


def test_engines_describe_prints_arguments_and_capabilities():
    out = _run("-m", "lora_conformance.cli", "engines", "describe", "vllm")
    assert out.returncode == 0, out.stderr
    for spec in arg_specs(engine_class("vllm").Args):
        assert any(line.split()[:1] == [spec.name] and spec.help[:30] in line for line in out.stdout.splitlines()), \
            spec.name
    assert "max_loras_per_batch   int     as max_loras" in out.stdout
    assert "eviction              choice  only lru" in out.stdout
    assert "mixed_batch" in out.stdout.split("capabilities (")[1]
    bad = _run("-m", "lora_conformance.cli", "engines", "describe", "vlm")
    assert bad.returncode == 2 and "unknown engine 'vlm'" in bad.stderr


# ---- capabilities known without starting ---------------------------------------------------


def _same(engine, device="cpu"):
    cls = type(engine)
    cfg = cls.parse_args(engine.args)
    assert class_capabilities(cls, cfg, engine.model_dir, device) == engine.capabilities, (
        cls.__name__, engine.model_dir.name, engine.args)
    assert cls.declared_limits(cfg, engine.model_dir, device) == engine.limits
    return engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from lora_conformance.models import resolve_base_model

    cache = tmp_path_factory.mktemp("engine-args-models")
    return {k: resolve_base_model(f"synthetic:{k}", cache) for k in ("llama", "moe", "encoder")}


@pytest.mark.parametrize("kind, args", [
    ("llama", {}), ("llama", {"prefix_cache": "0", "overlap_loading": "0"}), ("moe", {}), ("encoder", {}),
])
def test_builtin_class_declares_what_a_started_engine_reports(models, kind, args):
    from lora_conformance.engines.builtin import BuiltinEngine

    _same(BuiltinEngine(models[kind], "cpu", "float32", args)).close()


@pytest.mark.parametrize("kind", ["llama", "encoder"])
def test_peft_class_declares_what_a_started_engine_reports(models, kind):
    from lora_conformance.engines.peft_engine import PeftEngine

    _same(PeftEngine(models[kind], "cpu", "float32", {})).close()


def test_openvino_class_declares_what_a_started_engine_reports(models, tmp_path):
    pytest.importorskip("openvino_genai")
    from lora_conformance.engines.openvino_engine import OpenVINOEngine

    _same(OpenVINOEngine(models["llama"], "cpu", "float32", {"ir_cache": str(tmp_path / "ir"),
                                                              "max_rank": "32"})).close()
    # a model the converter refuses (an encoder: GenAI's embedding pipeline takes no adapters): the
    # class cannot say, the engine's start says why; a Mixtral is converted and declares moe
    cfg = OpenVINOEngine.parse_args({})
    assert OpenVINOEngine.declared_capabilities(cfg, models["encoder"], "cpu") is None
    assert Capability.MOE in OpenVINOEngine.declared_capabilities(cfg, models["moe"], "cpu")


def _fake_vllm(monkeypatch):
    """vLLM's async engine as far as start-up goes: the engine args it is given, resolved with
    vLLM's own defaults (prefix caching and chunked prefill on, CUDA graphs unless enforce_eager)."""
    from types import SimpleNamespace as NS

    class FakeEngineArgs:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class FakeAsyncLLM:
        def __init__(self, kwargs):
            self.kwargs = kwargs
            get = kwargs.get
            self.vllm_config = NS(
                cache_config=NS(enable_prefix_caching=get("enable_prefix_caching", True)),
                scheduler_config=NS(enable_chunked_prefill=True),
                model_config=NS(enforce_eager=get("enforce_eager", False)),
            )

        @classmethod
        def from_engine_args(cls, engine_args, usage_context=None):
            return cls(engine_args.kwargs)

        def shutdown(self):
            pass

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.engine", "vllm.engine.arg_utils", "vllm.usage", "vllm.usage.usage_lib", "vllm.v1",
        "vllm.v1.engine", "vllm.v1.engine.async_llm")}
    modules["vllm.engine.arg_utils"].AsyncEngineArgs = FakeEngineArgs
    modules["vllm.usage.usage_lib"].UsageContext = NS(LLM_CLASS="LLM_CLASS")
    modules["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("on, args", [
    ("cpu", {}), ("cpu", {"prefix_cache": "1", "max_loaded_loras": "3", "max_loras_per_batch": "2"}),
    ("cpu", {"prefix_cache": "0", "chunked_prefill_size": "13"}),
    ("cuda", {}), ("cuda", {"graphs": "1"}), ("cuda", {"graphs": "0"}), ("cuda", {"enforce_eager": "0"}),
])
def test_vllm_class_declares_what_a_started_engine_reports(models, monkeypatch, on, args):
    from lora_conformance.engines.vllm_engine import VllmEngine

    _fake_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the engine sets it where unset
    monkeypatch.setattr("lora_conformance.devices.set_start_method_for", lambda device: None)
    _same(VllmEngine(models["llama"], on, "float32", args), on).close()


@pytest.mark.parametrize("version, kind, args", [
    ("0.5.23", "llama", {}), ("0.5.23", "llama", {"prefix_cache": "0", "eviction": "fifo"}),
    ("0.5.23", "llama", {"overlap_loading": "1", "max_loras_per_batch": "2", "max_loaded_loras": "6"}),
    ("0.5.3", "llama", {}), ("0.5.23", "encoder", {"lora_target_modules": "all"}),
    ("0.5.23", "llama", {"capabilities": "mixed_batch,moe"}),
])
def test_sglang_class_declares_what_a_started_engine_reports(models, monkeypatch, version, kind, args):
    import _sglang_standin as standin

    from lora_conformance.engines.sglang_engine import SGLangEngine

    monkeypatch.setitem(sys.modules, "sglang", standin.module(version))
    _same(SGLangEngine(models[kind], "cpu", "float32", args))


def test_sglang_class_cannot_say_without_sglang(monkeypatch):
    from lora_conformance.engines.sglang_engine import SGLangEngine

    monkeypatch.setitem(sys.modules, "sglang", None)
    assert SGLangEngine.declared_capabilities(SGLangEngine.parse_args({}), None, "cpu") is None


@pytest.mark.parametrize("args", [{}, {"api_flavor": "sglang"}, {"capabilities": "mixed_batch pinning"},
                                  {"max_loras_per_batch": "2", "max_loaded_loras": "4", "max_rank": "16"}])
def test_openai_class_declares_what_a_started_engine_reports(models, args):
    from test_engine_openai import StandIn

    from lora_conformance.engines.openai_engine import OpenAIEngine
    from transformers import AutoTokenizer

    StandIn.tokenizer = AutoTokenizer.from_pretrained(str(models["llama"]))
    StandIn.loaded, StandIn.seen, StandIn.delay, StandIn.flavor = {}, [], 0.0, args.get("api_flavor", "vllm")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        _same(OpenAIEngine(models["llama"], "cpu", "float32", {"url": url, **args})).close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_subclass_that_changes_its_constructor_is_asked_by_starting_it():
    from lora_conformance.engines.builtin import BuiltinEngine

    class Changed(BuiltinEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.capabilities = self.capabilities | {Capability.TENSOR_PARALLEL}

    class Declared(Changed):
        @classmethod
        def declared_capabilities(cls, cfg, model_dir, device):
            return super().declared_capabilities(cfg, model_dir, device) | {Capability.TENSOR_PARALLEL}

    cfg = BuiltinEngine.parse_args({})
    assert class_capabilities(Changed, cfg, None, "cpu") is None
    assert Capability.TENSOR_PARALLEL in class_capabilities(Declared, cfg, None, "cpu")


# ---- the gate starts nothing for an undeclared feature -------------------------------------

GATED = '''
import os

from lora_conformance.engines.args import arg
from lora_conformance.engines.base import Capability, Engine, Limits
from lora_conformance.types import GenerationResult
from dataclasses import dataclass


@dataclass(frozen=True)
class CountingArgs:
    flag: bool = arg(False, "declares pinning when on")


class Counting(Engine):
    name = "counting"
    Args = CountingArgs

    @classmethod
    def declared_capabilities(cls, cfg, model_dir, device):
        return frozenset({Capability.MIXED_BATCH} | ({Capability.PINNING} if cfg.flag else set()))

    def __init__(self, model_dir, device, dtype, args):
        super().__init__(model_dir, device, dtype, args)
        with open(os.environ["STARTS_FILE"], "a") as f:
            f.write("start\\n")
        self.capabilities = self.declared_capabilities(self.parse_args(args), model_dir, device)
        self.limits = Limits(2, 4, 16)

    def load_adapter(self, name, path, pinned=False): ...
    def unload_adapter(self, name): ...
    def list_adapters(self): return []
    def generate(self, requests): return [GenerationResult([1], "x") for _ in requests]
'''

GATED_TESTS = '''
import pytest


@pytest.mark.requires("pinning")
def test_needs_pinning(device, dtype):
    pass


@pytest.mark.requires("mixed_batch")
def test_needs_mixed(lora):
    lora.engine


def test_asks_for_pinning(lora):
    if not lora.declares("pinning"):
        pytest.skip("no pinning declared")
'''


def test_undeclared_feature_starts_no_engine(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(counting_engine=GATED, test_gated=GATED_TESTS)
    pytester.syspathinsert()
    starts = tmp_path / "starts.txt"
    monkeypatch.setenv("STARTS_FILE", str(starts))
    monkeypatch.setenv("LORA_CONFORMANCE_LORA_CACHE", str(tmp_path / "cache"))
    for var in ("LORA_CONFORMANCE_DEVICE", "LORA_CONFORMANCE_DTYPE", "LORA_CONFORMANCE_ENGINE",
                "LORA_CONFORMANCE_ENGINE_ARG"):
        monkeypatch.delenv(var, raising=False)
    result = pytester.runpytest("--device=cpu", "--engine=counting_engine:Counting", "-k", "pinning", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*not certified: engine does not declare pinning*", "*no pinning declared*"])
    assert not starts.exists(), "an engine was started to skip an undeclared feature"
    result = pytester.runpytest("--device=cpu", "--engine=counting_engine:Counting", "--engine-arg", "flag=1")
    result.assert_outcomes(passed=3)
    assert starts.read_text().count("start") == 1  # the shared engine, for the test that uses it
    result = pytester.runpytest("--device=cpu", "--engine=counting_engine:Counting", "--engine-arg", "flga=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: engine 'counting': unknown engine argument 'flga' * did you mean flag?*"])


def test_a_declaration_is_a_plain_frozen_dataclass():
    @dataclasses.dataclass(frozen=True)
    class A:
        x: int = arg(3, "three", minimum=1)

    assert A().x == 3 and arg_specs(A)[0].expected() == "an integer >= 1"
