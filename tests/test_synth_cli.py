"""``lora-conformance synth``: builds what it says, refuses bad input with exit code 2 and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lora_conformance.cli import main


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "llama"
    assert main(["synth", "model", "llama", "--out", str(out)]) == 0
    return out


def test_model_then_adapter(base, tmp_path):
    assert (base / "config.json").is_file() and (base / "tokenizer.json").is_file()
    out = tmp_path / "ad"
    rc = main(["synth", "adapter", "--base", str(base), "--out", str(out), "--rank", "4", "--alpha", "8",
               "--rslora", "--rank-pattern", "v_proj=2", "--layers", "0,1", "--seed", "3"])
    assert rc == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (4, 8, True)
    assert cfg["rank_pattern"] == {"v_proj": 2} and cfg["layers_to_transform"] == [0, 1]
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--rank", "x"], "--rank"),
        (["--rank", "1000"], "rank"),
        (["--bias", "some"], "--bias"),
        (["--targets", "nope"], "--targets"),
        (["--rank-pattern", "v_proj"], "--rank-pattern"),
        (["--b-std", "-1"], "--b-std"),
        (["--layers", "a,b"], "--layers"),
    ],
)
def test_bad_adapter_input_names_the_field(base, tmp_path, capsys, argv, field):
    assert main(["synth", "adapter", "--base", str(base), "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_bad_model_kind_and_base(tmp_path, capsys):
    assert main(["synth", "model", "gpt", "--out", str(tmp_path / "m")]) == 2
    assert "llama, moe, encoder" in capsys.readouterr().err
    assert main(["synth", "adapter", "--base", str(tmp_path), "--out", str(tmp_path / "a")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_subprocess_round_trip(base, tmp_path):
    out = tmp_path / "sub"
    ok = subprocess.run([sys.executable, "-m", "lora_conformance.cli", "synth", "adapter", "--base", str(base),
                         "--out", str(out), "--zero"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith(str(out)) and (out / "adapter_model.safetensors").is_file()
    bad = subprocess.run([sys.executable, "-m", "lora_conformance.cli", "synth", "adapter", "--base", str(base),
                          "--out", str(out), "--bias", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--bias" in bad.stderr
