"""The static reader of register_*_ci calls: what it accepts and how it reports mistakes."""

from __future__ import annotations

import textwrap

import pytest

import lora_conformance.ci as ci
from lora_conformance.ci.registry import (
    DEFAULT_SUITES,
    Registration,
    RegistrationError,
    collect,
    collect_file,
    select,
    suite_files,
    suites_for,
)


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_calls_do_nothing_at_import_time():
    assert ci.register_cpu_ci(est_time=1, suite="per-commit") is None
    assert ci.register_cuda_ci(1, "per-commit", True, "why") is None
    assert ci.register_xpu_ci(est_time=1, suite="nightly-full", nightly=True) is None
    assert ci.register_npu_ci(est_time=1, suite="per-commit") is None
    assert ci.register_ci("tpu", 1, "per-commit") is None
    assert set(ci.__all__) == {"register_ci", "register_cpu_ci", "register_cuda_ci", "register_xpu_ci",
                               "register_npu_ci"}


def test_reads_every_form(tmp_path):
    path = write(tmp_path, "test_mixed.py", """
        import lora_conformance.ci
        from lora_conformance.ci import register_cpu_ci, register_ci, register_xpu_ci

        register_cpu_ci(est_time=40, suite="per-commit")
        register_xpu_ci(300, "nightly-full", True)
        lora_conformance.ci.register_cuda_ci(est_time=12.5, suite="per-commit", disabled="flaky driver")
        register_ci("tpu", 9, "nightly-full", nightly=True)

        def test_x():
            pass
        """)
    regs = collect_file(path)
    assert regs == [
        Registration(path, 5, "cpu", "per-commit", 40.0),
        Registration(path, 6, "xpu", "nightly-full", 300.0, nightly=True),
        Registration(path, 7, "cuda", "per-commit", 12.5, disabled="flaky driver"),
        Registration(path, 8, "tpu", "nightly-full", 9.0, nightly=True),
    ]


def test_generic_hardware_gets_the_default_suite_list():
    assert suites_for("tpu") == DEFAULT_SUITES
    assert "nightly-multi-gpu" in suites_for("cuda")


@pytest.mark.parametrize("call, expected", [
    ('register_cpu_ci(est_time=EST, suite="per-commit")', "argument 'est_time' must be a literal"),
    ('register_cpu_ci(est_time=1, suite="per-" + "commit")', "argument 'suite' must be a literal"),
    ('register_cpu_ci(est_time=1, suite="per-commit", timeout=3)', "unknown argument 'timeout'; accepted: est_time, suite, nightly, disabled"),
    ('register_cpu_ci(est_time="40", suite="per-commit")', "est_time=...) must be a number of seconds >= 0, got '40'"),
    ('register_cpu_ci(est_time=-1, suite="per-commit")', "must be a number of seconds >= 0"),
    ('register_cpu_ci(est_time=1, suite="per-commit", nightly="yes")', "nightly=...) must be True or False"),
    ('register_cpu_ci(est_time=1, suite="per-commit", disabled="")', "disabled=...) must be None or a non-empty reason"),
    ('register_cpu_ci(est_time=1, suite="percommit")', "unknown suite 'percommit' for hardware 'cpu'; known suites: per-commit, nightly-full"),
    ('register_cpu_ci(suite="per-commit")', "missing the required argument 'est_time'"),
    ('register_ci(est_time=1, suite="per-commit")', "missing the required argument 'hw'"),
    ('register_ci("", 1, "per-commit")', "hw=...) must be a non-empty string"),
    ('register_cpu_ci(1, "per-commit", False, None, 5)', "takes at most 4 arguments"),
    ('register_cpu_ci(**KW)', "does not accept **kwargs"),
    ('register_cpu_ci(*ARGS)', "does not accept *args"),
])
def test_errors_name_file_and_line(tmp_path, call, expected):
    path = write(tmp_path, "test_bad.py", f"import os\n\nEST = 1\n{call}\n")
    with pytest.raises(RegistrationError) as info:
        collect_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4: "), message
    assert expected in message


def test_nested_call_is_an_error(tmp_path):
    path = write(tmp_path, "test_nested.py", """
        import sys
        if sys.platform == "linux":
            register_cpu_ci(est_time=1, suite="per-commit")
        """)
    with pytest.raises(RegistrationError, match=rf"^{path}:4: register_cpu_ci\(\) must be called as a statement at module top level"):
        collect_file(path)


def test_duplicate_registration_is_an_error(tmp_path):
    path = write(tmp_path, "test_dup.py", """
        register_cpu_ci(est_time=1, suite="per-commit")
        register_cpu_ci(est_time=2, suite="per-commit", nightly=True)
        """)
    with pytest.raises(RegistrationError, match=r"test_dup.py:3: 'cpu'/'per-commit' is registered twice \(first at line 2\)"):
        collect_file(path)


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "test_broken.py", "x = 1\ndef (:\n")
    with pytest.raises(RegistrationError, match=r"test_broken.py:2: cannot parse"):
        collect_file(path)


def test_other_functions_are_ignored(tmp_path):
    path = write(tmp_path, "test_plain.py", "print('x')\nregister(1)\nfoo.register_cpu(3)\n")
    assert collect_file(path) == []


def test_select_honours_nightly_and_disabled(tmp_path):
    a = write(tmp_path, "test_a.py", 'register_cpu_ci(est_time=1, suite="per-commit")\n')
    b = write(tmp_path, "test_b.py", 'register_cpu_ci(est_time=1, suite="per-commit", nightly=True)\n')
    c = write(tmp_path, "test_c.py", 'register_cpu_ci(est_time=1, suite="per-commit", disabled="broken")\n')
    d = write(tmp_path, "test_d.py", 'register_xpu_ci(est_time=1, suite="per-commit")\n')
    write(tmp_path, "helper.py", 'register_cpu_ci(est_time=1, suite="per-commit")\n')  # not a suite file
    registry = collect(suite_files(tmp_path))
    assert sorted(p.name for p in registry) == ["test_a.py", "test_b.py", "test_c.py", "test_d.py"]
    run, disabled = select(registry, "cpu", "per-commit")
    assert set(run) == {a} and set(disabled) == {c}
    run, _ = select(registry, "cpu", "per-commit", nightly=True)
    assert set(run) == {a, b}
    run, _ = select(registry, "xpu", "per-commit")
    assert set(run) == {d}


def test_nightly_full_includes_per_commit(tmp_path):
    from lora_conformance.ci.registry import included_suites

    assert included_suites("nightly-full") == ("nightly-full", "per-commit")
    assert included_suites("per-commit") == ("per-commit",)
    a = write(tmp_path, "test_a.py", 'register_cpu_ci(est_time=1, suite="per-commit")\n')
    b = write(tmp_path, "test_b.py", 'register_cpu_ci(est_time=1, suite="nightly-full", nightly=True)\n')
    c = write(tmp_path, "test_c.py", 'register_cpu_ci(est_time=1, suite="per-commit", disabled="broken")\n'
                                     'register_cpu_ci(est_time=9, suite="nightly-full")\n')
    registry = collect(suite_files(tmp_path))
    run, disabled = select(registry, "cpu", "nightly-full", nightly=True)
    assert set(run) == {a, b, c} and not disabled  # c's own nightly-full registration wins
    assert run[c].est_time == 9.0
    run, disabled = select(registry, "cpu", "per-commit", nightly=True)
    assert set(run) == {a} and set(disabled) == {c}  # per-commit does not include nightly-full
