"""Expectation files: parsing, validation messages, feature and case matching, and the pytest
plugin run through pytester (registered from a conftest, and through --expectations).

The test files written here have no feature markers unless stated: a test's feature id is the one
its report row shows, ``suite/function`` (``test_sample.py::test_alpha`` is ``sample/alpha``)."""

from __future__ import annotations

import textwrap

import pytest

from lora_conformance.expectations import (
    PACKAGED_DIR,
    Expectation,
    ExpectationsPlugin,
    case_matches,
    default_expectations_path,
    load_expectations,
)

TESTS = """
    def test_alpha(): assert False
    def test_alpha_other(): assert True
    import pytest
    @pytest.mark.parametrize("x", ["cpu-a", "cpu-b", "gpu"])
    def test_param(x): assert not x.startswith("cpu")
    def test_fixed(): assert True
    def test_skipme(): raise SystemExit("must not run")
"""

ENTRIES = """
    # ---- engine bug class: routing ----
    [[expect]]
    feature = "sample/alpha"
    status = "xfail"
    reason = "routes base rows to slot 0"
    link = "https://github.com/example/engine/issues/1"

    [[expect]]
    feature = "sample/param"
    case = "cpu"
    status = "xfail"
    reason = "cpu params broken"
    link = ""

    [[expect]]
    feature = "sample/skipme"
    status = "skip"
    reason = "crashes the engine"
    link = ""

    [[expect]]
    feature = "sample/gone"
    status = "xfail"
    reason = "stale entry"
    link = ""
"""


def write(tmp_path, body, name="exp.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_parses_entries_in_order(tmp_path):
    entries = load_expectations(write(tmp_path, ENTRIES))
    assert [(e.feature, e.case) for e in entries][:2] == [("sample/alpha", ""), ("sample/param", "cpu")]
    assert entries[0].describe() == "expected: routes base rows to slot 0 (https://github.com/example/engine/issues/1)"
    assert entries[2].status == "skip" and entries[2].index == 3
    assert load_expectations(write(tmp_path, "# header comments only\n")) == []


@pytest.mark.parametrize("body, expected", [
    ('[[expect]]\nfeature = "a/b"\nstatus = "fail"\nreason = "r"\nlink = ""\n',
     r"entry 1: field 'status' is 'fail'; expected one of xfail, skip"),
    ('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nlink = ""\n', r"entry 1: field 'reason' is missing"),
    ('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\nlink = ""\n'
     '[[expect]]\nfeature = ""\nstatus = "skip"\nreason = "r"\n',
     r"entry 2: field 'feature' is ''; expected a non-empty string"),
    ('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\nlink = "see the tracker"\n',
     r"entry 1: field 'link' is 'see the tracker'; expected an http\(s\) URL or an empty string"),
    ('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\nowner = "me"\n',
     r"entry 1: unknown field\(s\) owner"),
    ('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\n'
     '[[expect]]\nfeature = "a/b"\nstatus = "xfail"\nreason = "r"\n',
     r"entry 2: field 'feature': 'a/b' repeats entry 1"),
    ('[skip]\nfeature = "a/b"\n', r"top level: unknown key\(s\) skip"),
    ('expect = "x"\n', r"'expect' must be an array of tables"),
    ('[[expect]\nfeature = "a/b"\n', r"not valid TOML"),
])
def test_bad_files_name_file_entry_field_and_expected_values(tmp_path, body, expected):
    path = write(tmp_path, body)
    with pytest.raises(pytest.UsageError, match=expected) as info:
        load_expectations(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(pytest.UsageError, match="cannot be read"):
        load_expectations(tmp_path / "nope.toml")


def test_feature_is_matched_whole_and_case_at_part_boundaries():
    e = Expectation("suite/x", "xfail", "r", "", 1)
    assert e.matches("suite/x") and e.matches("suite/x", "cpu-float32")  # every case of the feature
    assert not e.matches("suite/x_other") and not e.matches("suite/") and not e.matches("other/x")
    cpu = Expectation("suite/x", "xfail", "r", "", 1, case="cpu")
    assert cpu.matches("suite/x", "cpu-float32") and cpu.matches("suite/x", "cpu")
    assert not cpu.matches("suite/x", "gpu-float32") and not cpu.matches("suite/x")  # unparametrised: no case
    assert not cpu.matches("suite/y", "cpu-float32")
    assert not Expectation("suite/x", "xfail", "r", "", 1, case="cp").matches("suite/x", "cpu-float32")
    assert Expectation("suite/x", "skip", "r", "", 1, case="float32-A").matches("suite/x", "cpu-float32-A")
    assert case_matches("cpu-float32", "cpu-float32") and case_matches("float32", "cpu-float32-A")
    assert not case_matches("bfloat16", "cpu-bfloat16x") and not case_matches("cpu-A", "cpu-float32-A")


def test_longest_matching_case_wins(tmp_path):
    plugin = ExpectationsPlugin(write(tmp_path, """
        [[expect]]
        feature = "s/a"
        status = "skip"
        reason = "whole feature"
        [[expect]]
        feature = "s/a"
        case = "x"
        status = "xfail"
        reason = "just x"
        [[expect]]
        feature = "s/a"
        case = "x-1"
        status = "xfail"
        reason = "just x-1"
    """))
    assert plugin.lookup("s.py::test_a[x-1]", "s/a", "x-1").reason == "just x-1"
    assert plugin.lookup("s.py::test_a[x-2]", "s/a", "x-2").reason == "just x"
    assert plugin.lookup("s.py::test_a[y-1]", "s/a", "y-1").reason == "whole feature"
    assert plugin.lookup("t.py::test_a", "t/a", "") is None


def test_default_lookup_precedence(tmp_path, monkeypatch):
    monkeypatch.setattr("lora_conformance.expectations.PACKAGED_DIR", tmp_path)
    assert default_expectations_path("eng", "cpu") is None
    (tmp_path / "eng.toml").write_text("")
    assert default_expectations_path("eng", "cpu") == tmp_path / "eng.toml"
    (tmp_path / "eng-cpu.toml").write_text("")
    assert default_expectations_path("eng", "cpu") == tmp_path / "eng-cpu.toml"  # more specific wins
    assert default_expectations_path("eng", "xpu") == tmp_path / "eng.toml"
    assert default_expectations_path("my_pkg.mod:Engine", "cpu") is None


def test_packaged_files_are_valid():
    files = sorted(PACKAGED_DIR.glob("*.toml"))
    assert {f.name for f in files} >= {"peft.toml", "vllm-cpu.toml", "sglang.toml", "openai.toml"}
    for f in files:
        load_expectations(f)  # header comments only, for now: must still parse


def run_with_conftest(pytester, entries=ENTRIES, *args):
    pytester.makepyfile(test_sample=textwrap.dedent(TESTS))
    path = pytester.path / "exp.toml"
    path.write_text(textwrap.dedent(entries))
    pytester.makeconftest(f"""
        from lora_conformance.expectations import ExpectationsPlugin
        def pytest_configure(config):
            config.pluginmanager.register(ExpectationsPlugin({str(path)!r}), "exp-under-test")
    """)
    return pytester.runpytest("-p", "no:lora_conformance", "-rxXs", *args)


def test_plugin_marks_items_and_reports_unmatched(pytester):
    result = run_with_conftest(pytester)
    # test_alpha xfails (strict), test_alpha_other (feature sample/alpha_other) is untouched, the
    # two cpu cases (cpu-a, cpu-b) xfail, gpu passes, test_skipme is skipped without running.
    result.assert_outcomes(passed=3, xfailed=3, skipped=1)
    result.stdout.fnmatch_lines([  # in report order
        "*UnmatchedExpectationWarning*entry 4: feature 'sample/gone' matches no collected test*",
        "lora-conformance expectations *exp.toml: 4 entries, 3 tests marked xfail, 1 skipped, 1 unmatched",
        "  unmatched entry 4: sample/gone",
        "XFAIL test_sample.py::test_alpha - expected: routes base rows to slot 0 (https://github.com/example/engine/issues/1)",
        "*SKIPPED*expected: crashes the engine*",
    ])
    assert "must not run" not in result.stdout.str()


def test_strict_xfail_turns_an_unexpected_pass_into_a_failure(pytester):
    result = run_with_conftest(pytester, """
        [[expect]]
        feature = "sample/fixed"
        status = "xfail"
        reason = "fixed upstream since"
        link = ""
    """, "test_sample.py::test_fixed")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*expected: fixed upstream since*"])


def test_non_strict_xfail_reports_an_unexpected_pass_without_failing(pytester):
    result = run_with_conftest(pytester, """
        [[expect]]
        feature = "sample/fixed"
        status = "xfail"
        reason = "depends on engine state"
        link = ""
        strict = false
    """, "test_sample.py::test_fixed")
    result.assert_outcomes(xpassed=1)


def test_strict_false_is_only_for_xfail(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text('[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\nstrict = false\n')
    with pytest.raises(pytest.UsageError, match="entry 1: field 'strict'"):
        load_expectations(path)


def test_entries_for_suites_outside_the_run_are_not_reported(pytester):
    pytester.makepyfile(test_other="def test_o(): pass")
    result = run_with_conftest(pytester, ENTRIES, "test_other.py")
    result.assert_outcomes(passed=1)
    assert "UnmatchedExpectationWarning" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*4 entries, 0 tests marked xfail, 0 skipped, 0 unmatched*"])


def test_deselection_does_not_make_entries_stale(pytester):
    result = run_with_conftest(pytester, ENTRIES, "-k", "fixed")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*4 entries, 3 tests marked xfail, 1 skipped, 1 unmatched*"])


def test_bad_file_stops_the_run_with_a_usage_error(pytester):
    result = run_with_conftest(pytester, '[[expect]]\nfeature = "x/y"\nstatus = "maybe"\nreason = "r"\n')
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*exp.toml: entry 1: field 'status' is 'maybe'; expected one of xfail, skip*"])


def test_through_the_lora_conformance_plugin(pytester):
    """--expectations is read by the lead's plugin, which registers ExpectationsPlugin."""
    pytester.makepyfile(test_sample=textwrap.dedent(TESTS))
    path = pytester.path / "exp.toml"
    path.write_text(textwrap.dedent(ENTRIES))
    result = pytester.runpytest(f"--expectations={path}", "-rxXs", "--engine=builtin", "--device=cpu")
    result.assert_outcomes(passed=3, xfailed=3, skipped=1)
    result.stdout.fnmatch_lines([f"*expectations {path} (4 entries)*"])


# ---- feature entries: matched by the feature marker's id (and a parametrisation id) ----

FEATURE_TESTS = """
    import pytest

    @pytest.mark.feature("routing/base_rows", "base rows get no delta")
    def test_renamed_function(): assert False

    @pytest.mark.feature("routing/dtypes", "every dtype")
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16x"])
    @pytest.mark.parametrize("dev", ["cpu"])
    def test_each(dev, dtype): assert dtype != "bfloat16"

    def test_unmarked(): assert False
"""


def run_features(pytester, entries, *args):
    pytester.makepyfile(test_sample=textwrap.dedent(FEATURE_TESTS))
    path = pytester.path / "exp.toml"
    path.write_text(textwrap.dedent(entries))
    pytester.makeconftest(f"""
        from lora_conformance.expectations import ExpectationsPlugin
        def pytest_configure(config):
            config.addinivalue_line("markers", "feature(id, description): test marker")
            config.pluginmanager.register(ExpectationsPlugin({str(path)!r}), "exp-under-test")
    """)
    return pytester.runpytest("-p", "no:lora_conformance", "-rxXs", *args)


def test_feature_entries_match_by_marker_id_and_case(pytester):
    result = run_features(pytester, """
        [[expect]]
        feature = "routing/base_rows"
        status = "xfail"
        reason = "base rows get the last slot"
        link = ""

        [[expect]]
        feature = "routing/dtypes"
        case = "bfloat16"
        status = "xfail"
        reason = "bf16 only"
        link = ""

        [[expect]]
        feature = "sample/unmarked"
        status = "xfail"
        reason = "an unmarked test's feature is suite/function, as in the report"
        link = ""
    """)
    # renamed function matched through its marker; case "bfloat16" matches cpu-bfloat16 but
    # not cpu-bfloat16x (whole parts only) nor cpu-float32.
    result.assert_outcomes(passed=2, xfailed=3)
    result.stdout.fnmatch_lines(["*3 entries, 3 tests marked xfail, 0 skipped, 0 unmatched*"])
    out = result.stdout.str()
    assert "XFAIL test_sample.py::test_each[cpu-bfloat16] - expected: bf16 only" in out


def test_case_entry_beats_feature_entry(tmp_path):
    path = write(tmp_path, """
        [[expect]]
        feature = "x/f"
        status = "xfail"
        reason = "whole feature"

        [[expect]]
        feature = "x/f"
        case = "cpu-bfloat16"
        status = "xfail"
        reason = "one case"
    """)
    plugin = ExpectationsPlugin(path)
    assert plugin.lookup("suites/test_x.py::test_f[cpu-bfloat16]", "x/f", "cpu-bfloat16").reason == "one case"
    assert plugin.lookup("suites/test_x.py::test_f[cpu-float32]", "x/f", "cpu-float32").reason == "whole feature"
    # the node id is not matched: a feature named otherwise has no entry
    assert plugin.lookup("suites/test_x.py::test_f[cpu-float32]", "x/renamed", "cpu-float32") is None
    assert plugin.lookup("suites/test_y.py::test_f", "y/f", "") is None


def test_an_id_entry_is_refused_saying_what_to_write_instead(tmp_path):
    """Node-id prefix entries (``id = ...``) are gone: a file with one is refused, naming the file, the
    entry and the field, and saying to write the feature (and case) a report row shows."""
    for body in ('[[expect]]\nid = "test_x.py::test_f"\nstatus = "skip"\nreason = "r"\n',
                 '[[expect]]\nfeature = "a/b"\nstatus = "skip"\nreason = "r"\n'
                 '[[expect]]\nfeature = "x/f"\nid = "test_x.py::test_f[cpu"\ncase = "cpu"\nstatus = "xfail"\n'
                 'reason = "r"\n'):
        path = write(tmp_path, body)
        with pytest.raises(pytest.UsageError) as info:
            load_expectations(path)
        message = str(info.value)
        assert message.startswith(f"expectations file {path}: entry {body.count('[[expect]]')}: field 'id' "
                                  "(a node-id prefix) is no longer accepted; "), message
        assert 'write feature = "suite/name" (and case = "..." ' in message and "report's rows" in message, message


def test_unmatched_feature_entry_of_a_suite_in_the_run_is_reported(pytester):
    result = run_features(pytester, """
        [[expect]]
        feature = "routing/gone"
        status = "xfail"
        reason = "stale"
        link = ""

        [[expect]]
        feature = "other_suite/not_in_this_run"
        status = "xfail"
        reason = "another suite"
        link = ""
    """)
    result.stdout.fnmatch_lines(["*UnmatchedExpectationWarning*entry 1: feature 'routing/gone' matches no collected*",
                                 "*2 entries, 0 tests marked xfail, 0 skipped, 1 unmatched*",
                                 "  unmatched entry 1: routing/gone"])


@pytest.mark.parametrize("body, expected", [
    ('[[expect]]\nstatus = "skip"\nreason = "r"\n',
     r"entry 1: field 'feature' is missing; expected a non-empty string"),
    ('[[expect]]\nfeature = "Accuracy base"\nstatus = "skip"\nreason = "r"\n',
     r"entry 1: field 'feature' is 'Accuracy base'; expected a feature id of the form suite/name"),
    ('[[expect]]\nfeature = "a/b"\ncase = ""\nstatus = "skip"\nreason = "r"\n',
     r"entry 1: field 'case' is ''; expected a parametrisation id"),
    ('[[expect]]\nfeature = "a/b"\ncase = "c"\nstatus = "skip"\nreason = "r"\n'
     '[[expect]]\nfeature = "a/b"\ncase = "c"\nstatus = "xfail"\nreason = "r"\n',
     r"entry 2: field 'feature' and 'case': 'a/b \[case c\]' repeats entry 1"),
])
def test_bad_feature_entries_name_the_field(tmp_path, body, expected):
    with pytest.raises(pytest.UsageError, match=expected):
        load_expectations(write(tmp_path, body))


def test_shipped_files_use_feature_ids_that_exist():
    """Every packaged entry names a feature some suite test declares."""
    import ast

    from lora_conformance.settings import suites_dir

    declared = set()
    for path in suites_dir().glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "feature" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                declared.add(node.args[0].value)
    assert len(declared) > 40, declared
    for f in sorted(PACKAGED_DIR.glob("*.toml")):
        for e in load_expectations(f):
            assert e.feature in declared, f"{f.name} entry {e.index}: feature {e.feature!r} is declared by no suite test"
