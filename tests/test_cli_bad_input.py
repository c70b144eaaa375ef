"""Bad input to the synth CLI and to expectations files: each is refused with a
message naming the field and the value, never a traceback or a silently dropped value."""

from __future__ import annotations

import pytest

from lora_conformance.cli import main
from lora_conformance.expectations import load_expectations


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_bad") / "llama"
    assert main(["synth", "model", "llama", "--out", str(out)]) == 0
    return out


def test_out_naming_an_existing_file_is_refused(base, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert main(["synth", "adapter", "--base", str(base), "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(f) in err and "not a directory" in err and "Traceback" not in err
    assert main(["synth", "adapter", "--base", str(base), "--out", str(f / "under")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["synth", "model", "llama", "--out", str(f)]) == 2
    assert "--out" in capsys.readouterr().err


def test_layers_outside_the_model_are_refused(base, tmp_path, capsys):
    assert main(["synth", "adapter", "--base", str(base), "--out", str(tmp_path / "a"), "--layers", "0,99"]) == 2
    err = capsys.readouterr().err
    assert "--layers: 99 outside the base model's layers 0..3" in err, err
    assert not (tmp_path / "a").exists()


def test_rank_pattern_zero_blames_rank_pattern(base, tmp_path, capsys):
    assert main(["synth", "adapter", "--base", str(base), "--out", str(tmp_path / "a"),
                 "--rank-pattern", "q_proj=0"]) == 2
    err = capsys.readouterr().err
    assert "--rank-pattern" in err and "q_proj" in err and "--rank:" not in err, err


def test_expectations_file_that_is_not_utf8(tmp_path):
    f = tmp_path / "e.toml"
    f.write_bytes(b'[[expect]]\nfeature = "x/y"\nreason = "caf\xe9"\n')
    with pytest.raises(pytest.UsageError, match=r"e.toml: not UTF-8 \(invalid .* at byte \d+\)"):
        load_expectations(f)
