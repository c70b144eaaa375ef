"""The README and docs stay true: the README's Python examples run, .ci/run calls its test command, its
certification matrix is what the stored reports give, and the docs' tables are the catalogues' data."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FAULTS_DOC = (ROOT / "docs" / "faults.md").read_text()
ENGINES_DOC = (ROOT / "docs" / "engines.md").read_text()
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


def test_readme_stays_a_readme():
    """Method, engines and measurements live in docs/ and reports/; the README is for users. The
    generated certification matrix (a row per engine, device, dtype and mode) grows with the engines
    and is not counted; the prose is."""
    begin, end = README.index("<!-- certification matrix:"), README.index("<!-- end of the certification matrix -->")
    prose = README[:begin] + README[end:]
    assert len(prose.splitlines()) <= 205


def test_readme_matrix_is_generated_from_the_stored_reports():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "ci" / "readme_matrix.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def fault_row(fault: str) -> str:
    """docs/faults.md's table row for ``fault``, from the detection test's data."""
    from test_detection_power import (CATCHERS, NOT_YET_SHOWN_ON_GPU, SHOWN_ON_CPU_IN, SHOWN_ON_GPU_IN,
                                      SHOWN_ON_GPU_ONLY_IN, UNCAUGHT)

    from lora_conformance.engines.builtin.faults import DEVICE_ONLY_FAULTS, DTYPE_ONLY_FAULTS, FAULTS

    catch = ", ".join(f"`{c}`" for c in CATCHERS[fault])
    dtypes = DTYPE_ONLY_FAULTS[fault][0] if fault in DTYPE_ONLY_FAULTS else SHOWN_ON_CPU_IN
    caught = [d for d in dtypes if (fault, d) not in UNCAUGHT]
    missed = [d for d in dtypes if (fault, d) in UNCAUGHT]
    gpu_dtypes = (DTYPE_ONLY_FAULTS[fault][0] if fault in DTYPE_ONLY_FAULTS
                  else SHOWN_ON_GPU_ONLY_IN.get(fault, SHOWN_ON_GPU_IN))
    gpu = [] if fault in NOT_YET_SHOWN_ON_GPU else [d for d in gpu_dtypes if (fault, d) not in UNCAUGHT]
    if fault in DEVICE_ONLY_FAULTS:
        where = f"GPU ({DEVICE_ONLY_FAULTS[fault]}): {', '.join(gpu)}"
    else:
        where = f"cpu: {', '.join(caught)}" + (f"; GPU: {', '.join(gpu)}" if gpu else "")
    if missed:
        where += f" (missed on cpu in {', '.join(missed)}: a known gap, see UNCAUGHT)"
    return f"| `{fault}` | {FAULTS[fault]} | {catch} | {where} |"


def test_fault_table_is_the_detection_test_data():
    from lora_conformance.engines.builtin.faults import FAULTS

    for fault in FAULTS:
        assert fault_row(fault) in FAULTS_DOC, f"docs/faults.md row for {fault}: expected {fault_row(fault)}"


def test_variant_table_is_the_variant_catalogue():
    from lora_conformance.engines.builtin.variants import VARIANTS

    for name, what in VARIANTS.items():
        assert f"| `{name}` | {what} |" in ENGINES_DOC, f"docs/engines.md row for variant {name}"
