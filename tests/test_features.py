"""The feature marker: parsed, validated, and feeding the capability gate."""

import pytest

from lora_conformance.features import FeatureMarkerError, parse_marker


def test_parse_marker_fields():
    f = parse_marker(pytest.mark.feature("accuracy/base", "the base model", requires=("prompt_logprobs",)).mark, "t")
    assert (f.id, f.description, f.requires, f.suite) == ("accuracy/base", "the base model", ("prompt_logprobs",),
                                                          "accuracy")
    assert parse_marker(pytest.mark.feature("a/b", "d", requires="moe").mark, "t").requires == ("moe",)


@pytest.mark.parametrize("mark, problem", [
    (pytest.mark.feature("NoSlash", "d"), "suite/name"),
    (pytest.mark.feature("a/b", ""), "description"),
    (pytest.mark.feature("a/b", "d", colour="red"), "colour"),
    (pytest.mark.feature("a/b", "d", requires=(1,)), "requires"),
])
def test_parse_marker_errors_name_the_field(mark, problem):
    with pytest.raises(FeatureMarkerError, match=problem) as exc:
        parse_marker(mark.mark, "suites/test_x.py::test_y")
    assert "suites/test_x.py::test_y" in str(exc.value)


def test_feature_requires_gate_the_test(pytester):
    pytester.makepyfile(test_gate="""
        import pytest

        @pytest.mark.feature("gate/needs_dora", "DoRA", requires=("dora",))
        def test_needs_dora(lora):
            raise AssertionError("must not run: builtin does not declare dora")

        @pytest.mark.feature("gate/plain", "no capability needed")
        def test_plain():
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*not certified*dora*"])


@pytest.mark.parametrize("body, message", [
    ('@pytest.mark.feature("bad id", "d")\ndef test_a():\n    pass\n', "suite/name"),
    ('@pytest.mark.feature("s/x", "d")\ndef test_a():\n    pass\n\n'
     '@pytest.mark.feature("s/x", "d")\ndef test_b():\n    pass\n', "already declared"),
    ('@pytest.mark.feature("s/x", "d", requires=("warp_drive",))\ndef test_a():\n    pass\n', "warp_drive"),
])
def test_bad_markers_are_usage_errors(pytester, body, message):
    pytester.makepyfile(test_bad="import pytest\n\n" + body)
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])
