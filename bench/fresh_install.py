"""The plain-install user path, end to end: build the wheel, install it (not editable) into a fresh
virtual environment, and certify from a directory outside the checkout.

    python bench/fresh_install.py [--work DIR] [--keep] [-- CERTIFY_ARGS...]

The new environment sees the packages of the environment that runs this script (torch,
transformers and PEFT are not downloaded): a ``.pth`` file in its site-packages adds the running
interpreter's own site directories, whether that is a virtual environment, a conda environment or
the system Python (``python -m venv --system-site-packages`` would give the *base* interpreter's
packages inside a venv, not the venv's). lora-conformance itself comes from the wheel: the script
checks that ``lora_conformance`` imports from inside the new environment, not from the checkout or
an editable install. Prints what each step took, the package's location, the certify command and
its badge line; exits with certify's status. tests/test_wheel_install.py runs the same steps on a
subset of the suites.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a wheel is built from (a copy, so the build leaves no build/ or *.egg-info in the checkout).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "lora_conformance", "suites", "fixtures")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would import the checkout or load our plugin anyway."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_PLUGINS", "PYTEST_ADDOPTS") and not k.startswith("PYTEST_XDIST")}
    env.update(extra)
    return env


def build_wheel(out_dir: Path) -> Path:
    src = out_dir / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out_dir / "dist"), str(src)]
    try:
        # With this environment's setuptools: nothing is fetched.
        subprocess.run([*cmd, "--no-build-isolation", "--no-index"], check=True, env=clean_env(), cwd=out_dir)
    except subprocess.CalledProcessError:
        # This environment cannot build it (no setuptools that builds wheels): as `pip install .`
        # would, with the build requirements of pyproject.toml from the configured index.
        subprocess.run(cmd, check=True, env=clean_env(), cwd=out_dir)
    [wheel] = (out_dir / "dist").glob("lora_conformance-*.whl")
    return wheel


def site_dirs() -> list[str]:
    """The directories the running interpreter imports installed packages from, in ``sys.path``
    order: its site-packages (a venv's own; the base installation's too where the venv includes
    them; a conda environment's; the system Python's), sysconfig's purelib/platlib, and the user
    site where it is enabled. Only directories that exist and are on ``sys.path``."""
    candidates = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    norm = lambda p: os.path.normcase(os.path.realpath(p))  # noqa: E731
    position: dict[str, int] = {}
    for i, entry in enumerate(sys.path):
        if entry:
            position.setdefault(norm(entry), i)
    found: dict[str, str] = {}
    for path in candidates:
        if path and os.path.isdir(path) and norm(path) in position:
            found.setdefault(norm(path), path)
    return sorted(found.values(), key=lambda p: position[norm(p)])


PTH_NAME = "_lora_conformance_running_env.pth"


def make_venv(path: Path, wheel: Path) -> Path:
    """A fresh environment seeing the running environment's packages, with lora-conformance
    installed from the wheel."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    # A line that starts with "import" in a .pth file is run at start-up: site.addsitedir appends
    # each directory after the new environment's own site-packages and processes the .pth files
    # there too (what --system-site-packages does for the base installation).
    (Path(purelib) / PTH_NAME).write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs()) + "\n")
    # This interpreter's pip, run by the new environment's python, installs into the new environment.
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   env=clean_env(), cwd=path)
    return python


def package_location(python: Path, cwd: Path) -> dict:
    code = ("import json, lora_conformance, lora_conformance.suites as s, lora_conformance.fixtures as f; "
            "from lora_conformance.settings import suites_dir, fixtures_dir; "
            "print(json.dumps({'package': lora_conformance.__file__, 'suites': str(suites_dir()), "
            "'fixtures': str(fixtures_dir()), 'version': lora_conformance.__version__}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=clean_env(), cwd=cwd, check=True)
    return json.loads(done.stdout)


def certify(venv: Path, cwd: Path, report: Path, extra: list[str], env: dict[str, str] | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    cmd = [str(venv / "bin" / "lora-conformance"), "certify", "--device", "cpu", "--report", str(report), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or clean_env(), cwd=cwd, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("certify_args", nargs=argparse.REMAINDER, help="after --: more certify arguments")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="lc-fresh-"))
    work.mkdir(parents=True, exist_ok=True)
    extra = args.certify_args[1:] if args.certify_args[:1] == ["--"] else args.certify_args
    try:
        t0 = time.perf_counter()
        wheel = build_wheel(work)
        t1 = time.perf_counter()
        python = make_venv(work / "venv", wheel)
        t2 = time.perf_counter()
        outside = work / "user"
        outside.mkdir(exist_ok=True)
        where = package_location(python, outside)
        inside = all(Path(where[k]).resolve().is_relative_to((work / "venv").resolve()) for k in ("package", "suites", "fixtures"))
        print(f"wheel: {wheel.name} ({t1 - t0:.1f} s); venv + install: {t2 - t1:.1f} s")
        print(f"lora_conformance {where['version']} from {where['package']} (inside the new environment: {inside})")
        if not inside:
            print("error: lora_conformance does not come from the wheel", file=sys.stderr)
            return 1
        done = certify(work / "venv", outside, outside / "lora-report", extra)
        t3 = time.perf_counter()
        tail = [l for l in done.stdout.splitlines() if l.startswith(("workers:", "running:", "report:", "badge:"))]
        print("\n".join(tail))
        if done.returncode not in (0, 1):
            print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        report = outside / "lora-report" / "report.json"
        if report.exists():
            summary = json.loads(report.read_text())["verdict"]["summary"]
            print(f"verdict: {json.dumps(summary, sort_keys=True)}")
        print(f"certify: exit {done.returncode}, {t3 - t2:.1f} s")
        return done.returncode
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
