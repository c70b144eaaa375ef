"""lora-conformance certify: the pytest command it builds, its exit codes, what it prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from lora_conformance import launch as certify
from lora_conformance.report.document import build_report, write_report
from lora_conformance.settings import suites_dir


def parse(*argv):
    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_pytest_command(tmp_path):
    args = parse("--device", "xpu", "--engine", "sglang", "--engine-arg", "tp=2", "--engine-arg", "mem=0.5",
                 "--dtype", "bfloat16", "--base-model", "synthetic:moe", "--report", str(tmp_path / "r"),
                 "--suite-dir", str(tmp_path), "--", "-n", "4", "-k", "mixed_batch")
    plugins = [a for name in certify.suite_plugins() for a in ("-p", name)]
    assert certify._pytest_has_autoload_flag()  # pyproject asks for pytest>=8.4
    isolation = ["-c", str(suites_dir() / "certify.ini"), f"--rootdir={tmp_path.parent}", f"--confcutdir={tmp_path}",
                 "-o", f"cache_dir={Path.cwd() / '.pytest_cache'}"]
    assert certify.pytest_command(args) == [
        sys.executable, "-m", "pytest", str(tmp_path), "--device=xpu", "--engine=sglang", "--engine-arg=tp=2",
        "--engine-arg=mem=0.5", "--base-model=synthetic:moe", "--dtype=bfloat16",
        "--disable-plugin-autoload", *plugins, *isolation,
        f"--lora-report={(tmp_path / 'r').resolve()}", "-n", "4", "-k", "mixed_batch"]


def test_every_plugin_option_is_a_certify_option_passed_on_as_given(tmp_path):
    """One declaration (lora_conformance.options): certify offers each plugin option (its --report
    stands for --lora-report) and hands on exactly what was given; the rest the plugin resolves."""
    from lora_conformance.options import OPTIONS

    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    text = parser.format_help()
    for o in OPTIONS:
        assert (o.flag in text) == (o.name != "lora_report"), o.flag
    args = parse("--device", "cpu", "--lora-cache", str(tmp_path), "--lora-refresh-references", "--lora-threads", "2",
                 "--expectations", "x.toml", "--report", str(tmp_path / "r"))
    cmd = certify.pytest_command(args)
    given = [a for a in cmd if a.startswith("--") and "=" in a or a == "--lora-refresh-references"]
    assert given[:5] == ["--device=cpu", f"--lora-cache={tmp_path}", "--lora-refresh-references", "--lora-threads=2",
                         "--expectations=x.toml"]
    assert not any(a.startswith(("--engine=", "--dtype=", "--base-model=")) for a in cmd)
    with pytest.raises(SystemExit):
        parse("--engine", "builtin")  # --device is required
    with pytest.raises(SystemExit):
        parse("--device", "cpu", "--dtype", "float64")  # the table's choices


def test_only_the_suites_plugins_are_loaded_unless_asked(tmp_path):
    cmd = certify.pytest_command(parse("--device", "cpu", "--report", str(tmp_path)))
    assert "--disable-plugin-autoload" in cmd
    loaded = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-p"]
    assert loaded[0] == "lora_conformance.plugin" and set(loaded) <= set(certify.SUITE_PLUGINS)
    assert "xdist.plugin" in loaded and "_hypothesis_pytestplugin" in loaded  # both are test extras here
    everything = certify.pytest_command(parse("--device", "cpu", "--autoload-plugins", "--report", str(tmp_path)))
    assert "--disable-plugin-autoload" not in everything
    # Installed, lora_conformance.plugin is not auto-loaded (the entry point is inert): it is still named.
    assert [everything[i + 1] for i, a in enumerate(everything) if a == "-p"] == ["lora_conformance.plugin"]


def test_an_older_pytest_gets_the_environment_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(certify, "_pytest_has_autoload_flag", lambda: False)
    seen = []
    args = parse("--device", "cpu", "-n", "1", "--report", str(tmp_path))
    certify.run(args, runner=lambda cmd, **kw: seen.append((cmd, kw)) or 1)
    cmd, kw = seen[0]
    assert "--disable-plugin-autoload" not in cmd and kw["env"]["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    assert cmd[cmd.index("-p") + 1] == "lora_conformance.plugin"
    assert "running: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " in capsys.readouterr().out


def test_an_installed_plugin_cannot_change_the_verdict(tmp_path, capsys, monkeypatch):
    """A plugin that turns failures into passes (as a rerun plugin can for a flaky one) is installed
    through an entry point: certify does not load it; --autoload-plugins does (and the verdict flips)."""
    site = tmp_path / "site"
    (site / "greenwash-0.1.dist-info").mkdir(parents=True)
    (site / "greenwash-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: greenwash\nVersion: 0.1\n")
    (site / "greenwash-0.1.dist-info" / "entry_points.txt").write_text("[pytest11]\ngreenwash = greenwash_plugin\n")
    (site / "greenwash_plugin.py").write_text(
        "import pytest\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    rep = outcome.get_result()\n"
        "    if rep.failed:\n"
        "        rep.outcome = 'passed'\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_tiny.py").write_text("def test_broken():\n    assert False\n")
    common = ["--device", "cpu", "--engine", "builtin", "--suite-dir", str(suites), "-n", "1"]
    args = parse(*common, "--report", str(tmp_path / "rep"), "--", "-p", "no:cacheprovider", "-q")
    assert certify.run(args) == 1
    out = capsys.readouterr().out
    assert "LoRA conformance · cpu · 0/1 (not certified)" in out
    assert "other installed pytest plugins are not loaded" in out
    plugins = json.loads((tmp_path / "rep" / "report.json").read_text())["environment"]["pytest_plugins"]
    assert plugins["autoload"] is False and not any("greenwash" in p for p in plugins["loaded"])
    args = parse(*common, "--autoload-plugins", "--report", str(tmp_path / "rep2"), "--", "-p", "no:cacheprovider", "-q")
    certify.run(args)
    assert "LoRA conformance · cpu · 1/1 (certified)" in capsys.readouterr().out  # what certify's default prevents
    plugins = json.loads((tmp_path / "rep2" / "report.json").read_text())["environment"]["pytest_plugins"]
    assert plugins["autoload"] is True and "greenwash 0.1" in plugins["loaded"]  # the report names it
    assert "greenwash 0.1" in (tmp_path / "rep2" / "report.md").read_text()


def test_defaults():
    args = parse("--device", "cpu", "--engine", "builtin")
    cmd = certify.pytest_command(args)
    assert cmd[3].endswith("suites") and cmd[-1].endswith("lora-report") and cmd[-1].startswith("--lora-report=/")


def test_no_tests_collected_is_an_error(tmp_path, capsys):
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path))
    assert certify.run(args, runner=lambda cmd: 5) == 5
    assert "no tests were collected" in capsys.readouterr().err


def test_prints_report_and_badge_and_returns_pytest_code(tmp_path, capsys):
    report_dir = tmp_path / "rep"

    def fake_pytest(cmd):
        assert f"--lora-report={report_dir.resolve()}" in cmd
        assert not (report_dir / "report.json").exists()  # the stale report was removed first
        write_report(build_report({"device": {"type": "xpu"}}, [
            {"nodeid": "s/test_a.py::test_x", "phases": {"setup": "passed", "call": "failed"}, "message": "m"},
            {"nodeid": "s/test_a.py::test_y", "phases": {"setup": "passed", "call": "passed"}}]), report_dir)
        return 1

    write_report(build_report({}, []), report_dir)  # stale
    args = parse("--device", "xpu", "--engine", "openai", "--report", str(report_dir))
    assert certify.run(args, runner=fake_pytest) == 1
    out = capsys.readouterr().out
    assert f"report: {report_dir.resolve() / 'report.html'}" in out
    assert "(LoRA conformance · xpu · 1/2 (not certified))" in out


def test_missing_report_is_an_error(tmp_path, capsys):
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path))
    assert certify.run(args, runner=lambda cmd: 0) == 1
    assert "no report was written (pytest exit code 0)" in capsys.readouterr().err


def test_a_pytest_killed_by_a_signal_is_named_with_what_to_do(tmp_path, capsys):
    """pytest itself killed (a segfault in an engine's native code takes a run without workers, and
    its report, with it): certify names the signal, and without workers says -n 2 isolates it."""
    import signal

    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path), "-n", "1")
    assert certify.run(args, runner=lambda cmd: -signal.SIGSEGV) == 128 + signal.SIGSEGV  # as a shell says
    err = capsys.readouterr().err
    assert "no report was written (pytest was killed by SIGSEGV; a crash in the engine's native code" in err
    assert "with -n 2 or more, pytest-xdist isolates it" in err
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path), "-n", "2")
    certify.run(args, runner=lambda cmd: -signal.SIGKILL)
    err = capsys.readouterr().err
    assert "(pytest was killed by SIGKILL)" in err and "isolates" not in err


def test_certify_runs_pytest_for_real(tmp_path, capsys):
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_tiny.py").write_text("def test_ok():\n    pass\n")
    args = parse("--device", "cpu", "--engine", "builtin", "--report", str(tmp_path / "rep"),
                 "--suite-dir", str(suites), "--", "-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-q")
    assert certify.run(args) == 0
    assert "LoRA conformance · cpu · 1/1 (certified)" in capsys.readouterr().out
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["verdict"]["features"]["tiny/ok"]["status"] == "passed"


def test_a_bad_engine_configuration_runs_nothing(tmp_path, capsys):
    write_report(build_report({}, []), tmp_path)  # stale
    args = parse("--device", "cpu", "--engine-arg", "max_loras_per_bach=2", "--report", str(tmp_path))
    assert certify.run(args, runner=lambda cmd: pytest.fail("pytest was started")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean max_loras_per_batch?" in err and "no report was written" in err
    assert not (tmp_path / "report.json").exists()
