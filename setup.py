"""The package list, which pyproject.toml cannot state: every ``lora_conformance*`` package found
here, plus the suites and fixtures that live at the top of the repository and ship inside the
package (``[tool.setuptools.package-dir]`` in pyproject.toml maps them). Everything else is in
pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["lora_conformance*"], exclude=["*__pycache__*"])
      + ["lora_conformance.suites", "lora_conformance.fixtures"])
