"""Signed reports: ``report keygen|sign|verify --key``. A report relabelled (another engine or
device in its environment) or edited with its records digest recomputed still passes the digest
check (the digest is recomputed), but fails verification with the key; so does one signed by another key."""

from __future__ import annotations

import argparse
import json
import stat

import pytest

pytest.importorskip("cryptography")

from lora_conformance.report import cli as report_cli
from lora_conformance.report.document import build_report, report_digest, write_report
from lora_conformance.report.signing import SIGNATURE_EXIT, canonical_bytes

RECORDS = [
    {"nodeid": "suites/test_accuracy.py::test_single_adapter_matches_reference[A]",
     "phases": {"setup": "passed", "call": "failed", "teardown": "passed"}, "message": "slot 0 wrong",
     "duration": 1.5},
    {"nodeid": "suites/test_lifecycle.py::test_load_unload_reload",
     "phases": {"setup": "passed", "call": "passed", "teardown": "passed"}, "duration": 0.5},
]


def _cli(*argv):
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    return report_cli.run(parser.parse_args([str(a) for a in argv]))


@pytest.fixture
def keys(tmp_path):
    priv, pub = tmp_path / "vendor.key", tmp_path / "vendor.pub"
    assert _cli("keygen", "--private", priv, "--public", pub) == 0
    return priv, pub


@pytest.fixture
def signed(tmp_path, keys):
    out = tmp_path / "run"
    write_report(build_report({"engine": {"name": "builtin"}, "device": {"type": "cpu"}}, RECORDS), out)
    assert _cli("sign", out / "report.json", "--key", keys[0]) == 0
    return out / "report.json"


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_keygen_writes_a_private_key_only_its_owner_reads(keys):
    priv, pub = keys
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in priv.read_bytes() and b"PUBLIC KEY" in pub.read_bytes()
    assert _cli("keygen", "--private", priv, "--public", pub) == 2, "never overwrites a key"


def test_signed_report_verifies_with_the_key(signed, keys, capsys):
    assert _cli("verify", signed, "--key", keys[1]) == 0
    out = capsys.readouterr().out
    assert "signature ok" in out and "digest ok" in out


def _relabel(data):
    data["environment"]["engine"]["name"] = "vllm"
    data["environment"]["device"] = {"type": "cuda", "name": "NVIDIA H200"}


def _rechecksum(data):
    for rec in data["records"]:
        rec["phases"]["call"] = "passed"
        rec.pop("message", None)
    data["digest"] = report_digest(data)  # what anyone editing a report can recompute


@pytest.mark.parametrize("tamper", [_relabel, _rechecksum], ids=["relabelled", "re-checksummed"])
def test_a_tampered_report_fails_verification_with_the_key(signed, keys, capsys, tamper):
    _edit(signed, tamper)
    assert _cli("verify", signed, "--key", keys[1]) == SIGNATURE_EXIT
    assert "does not match the report" in capsys.readouterr().err


def test_another_key_or_no_signature_fails(signed, keys, tmp_path, capsys):
    other_priv, other_pub = tmp_path / "o.key", tmp_path / "o.pub"
    assert _cli("keygen", "--private", other_priv, "--public", other_pub) == 0
    assert _cli("verify", signed, "--key", other_pub) == SIGNATURE_EXIT
    assert "not with the given key" in capsys.readouterr().err
    _edit(signed, lambda d: d.pop("signature"))
    assert _cli("verify", signed, "--key", keys[1]) == SIGNATURE_EXIT
    assert "not signed" in capsys.readouterr().err
    assert _cli("verify", signed, "--key", keys[0]) == SIGNATURE_EXIT  # a private key is not a public key
    assert "not a PEM public key" in capsys.readouterr().err


def test_the_signature_covers_every_field_but_itself_and_the_derived_digest(signed):
    data = json.loads(signed.read_text())
    body = canonical_bytes(data)
    assert set(json.loads(body)) == set(data) - {"signature", "digest"}
    assert canonical_bytes({**data, "signature": {"value": "x"}}) == body
