"""The command line a user meets first: --version, one-line help for every subcommand, and examples
under each that the parser accepts as written."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

import lora_conformance
from lora_conformance import cli


def test_version_names_the_version_and_the_installation(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"lora-conformance {lora_conformance.__version__} from ")
    assert out.split(" from ", 1)[1].startswith(str(__import__("pathlib").Path(lora_conformance.__file__).resolve().parent))


def test_python_dash_m_has_the_same_command():
    done = subprocess.run([sys.executable, "-m", "lora_conformance", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(f"lora-conformance {lora_conformance.__version__} ")
    done = subprocess.run([sys.executable, "-m", "lora_conformance", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage: python -m lora_conformance" in done.stdout
    assert "torch" not in done.stderr


def test_the_version_is_the_distributions():
    from importlib.metadata import version

    assert version("lora-conformance") == lora_conformance.__version__


def test_top_level_help_lists_every_subcommand_with_a_line_and_examples():
    text = cli.build_parser().format_help()
    for name, (_, help_) in cli.SUBCOMMANDS.items():
        assert f"{name}" in text and help_ in text
    assert "examples:" in text and "--version" in text


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_every_subcommand_shows_examples_the_parser_accepts(name):
    assert name in cli.EXAMPLES, f"{name}: no examples under its --help (cli.EXAMPLES)"
    parser = cli.build_parser(name)
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    assert "examples:" in sub.format_help() and cli.SUBCOMMANDS[name][1] in sub.format_help()
    for line in cli.EXAMPLES[name].splitlines():
        words = shlex.split(line, comments=True)
        assert words[:2] == ["lora-conformance", name], line
        args = parser.parse_args(words[1:])  # exits (SystemExit) on an example the parser rejects
        assert args.command == name
