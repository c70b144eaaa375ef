"""The README stays true: its Python examples run, and .ci/run calls its test command."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "readme_example"})


def test_ci_runs_exactly_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_command = next(c.strip() for c in commands if "pytest" in c and "certify" not in c)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci], f".ci/run does not run {test_command!r}"


def test_readme_fault_table_is_the_detection_test_data():
    from test_detection_power import CATCHERS, DTYPES, NOT_YET_SHOWN_ON_GPU, UNCAUGHT

    from lora_conformance.engines.builtin.faults import DEVICE_ONLY_FAULTS, DTYPE_ONLY_FAULTS, FAULTS

    for fault in FAULTS:
        catch = ", ".join(f"`{c.replace('test_', '', 1).replace('.py::test_', '::')}`" for c in CATCHERS[fault])
        where = (f"GPU ({DEVICE_ONLY_FAULTS[fault]})" if fault in DEVICE_ONLY_FAULTS
                 else "cpu" if fault in NOT_YET_SHOWN_ON_GPU else "cpu, GPU")
        dtypes = DTYPE_ONLY_FAULTS[fault][0] if fault in DTYPE_ONLY_FAULTS else DTYPES
        missed = [d for d in dtypes if (fault, d) in UNCAUGHT]
        where += "; " + ", ".join(d for d in dtypes if d not in missed)
        if missed:
            where += f" (missed in {', '.join(missed)}: issue 11)"
        assert f"| `{fault}` | {FAULTS[fault]} | {catch} | {where} |" in README, f"README row for {fault}"


def test_readme_variant_table_is_the_variant_catalogue():
    from lora_conformance.engines.builtin.variants import VARIANTS

    for name, what in VARIANTS.items():
        assert f"| `{name}` | {what} |" in README, f"README row for variant {name}"
