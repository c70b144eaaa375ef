"""The scoreboard (lora_conformance.scoreboard) and submissions (lora_conformance.submit): cells per
feature, columns per product and suite version, the aligned view, integrity (digest, signature)
shown and never hidden, revocations, the site from the stored reports, and what submit refuses and writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

import _scoreboard_reports as R  # noqa: E402
from lora_conformance import submit  # noqa: E402
from lora_conformance.report.document import reverify  # noqa: E402
from lora_conformance.report.html import case_anchor, feature_anchor  # noqa: E402
from lora_conformance.scoreboard import board, build, integrity, suite_version_of  # noqa: E402
from lora_conformance.scoreboard import cli as scoreboard_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cells(data):
    verdict, _ = reverify(data)
    return board.feature_cells(data, verdict)


def test_cells_tell_waived_from_xfail_and_link_a_failure_to_its_case():
    cells = _cells(R.report("certified"))
    assert {f: c.status for f, c in cells.items()} == {
        "accuracy/single_adapter_matches_reference": "passed", "mixed_batch/nearest_reference_routing": "failed",
        "dora/dora": "waived", "pinning/pinned": "not certified"}
    failed = cells["mixed_batch/nearest_reference_routing"]
    assert failed.anchor == case_anchor(R.ROUTING) and failed.diagnosis == R.DIAGNOSIS
    assert cells["accuracy/single_adapter_matches_reference"].anchor == feature_anchor(
        "accuracy/single_adapter_matches_reference")
    assert cells["dora/dora"].waivers[0]["issue"] == R.ISSUE
    # An open run's expectation is an xfail, not a waiver of the certification program.
    assert _cells(R.report("open"))["dora/dora"].status == "xfail"
    assert _cells(R.report(None))["dora/dora"].status == "xfail"


def test_counts_read_passed_and_waived_apart():
    c = board.counts(_cells(R.report("certified")).values())
    assert (c["passed"], c["waived"], c["failed"], c["not certified"], c["counted"]) == (1, 1, 1, 1, 4)
    assert board.count_text(c, "certified") == "1 passed, 1 waived / 4"
    assert board.count_text(board.counts(_cells(R.report("open")).values()), "open") == "1 passed, 1 xfail / 4"


def test_the_suite_version_comes_from_the_certification_then_the_selection_then_the_environment():
    data = R.report("certified", suite="0.3.0")
    assert suite_version_of(data) == "0.3.0"
    assert suite_version_of({**data, "certification": None}) == "0.3.0"  # selection.suite.version
    assert suite_version_of({"environment": {"suite_version": "0.0.9"}}) == "0.0.9"  # schema-1 reports
    assert suite_version_of({}) == "unknown"


def test_variants_name_the_arguments_that_select_one():
    assert board.variant_of({"mode": "served", "startup_timeout": "600"}) == "mode=served"
    assert board.variant_of({"server_cmd": "python -m vllm.entrypoints.openai.api_server " * 3}) == "server_cmd=…"


def _tree(tmp_path, files: dict) -> Path:
    root = tmp_path / "reports"
    for name, data in files.items():
        R.store(data, root / name)
    return root


def test_one_column_per_product_and_suite_version_a_complete_run_first(tmp_path):
    day = "2030-" + "01-0{}T00:00:00+00:00"
    root = _tree(tmp_path, {
        "a-old.json": R.report(date=day.format(1)),
        "a-new-partial.json": R.report(date=day.format(3), partial=True),
        "a-newer.json.gz": R.report(date=day.format(2)),
        "a-served.json": R.report(date=day.format(1), args={"mode": "served"}),
        "b.json.xz": R.report(engine="sglang", date=day.format(1)),
    })
    b = build.read_board(root)
    assert [c.rel for c in b.columns] == ["b.json.xz", "a-newer.json.gz", "a-served.json"]  # sglang < vllm
    superseded = {e.rel: e.superseded_by for e in b.entries if e.superseded_by}
    assert superseded == {"a-old.json": "a-newer", "a-new-partial.json": "a-newer"}


def test_the_aligned_view_keeps_only_suite_versions_every_product_ran(tmp_path):
    root = _tree(tmp_path, {
        "vllm-1.json": R.report(suite="0.1.0"), "vllm-2.json": R.report(suite="0.2.0"),
        "sglang-2.json": R.report(engine="sglang", suite="0.2.0"),
    })
    b = build.read_board(root)
    assert len(b.columns) == 3 and board.aligned_versions(b.columns) == {"0.2.0"}
    out = tmp_path / "site"
    build.write_site(b, out)
    index, aligned = (out / "index.html").read_text(), (out / "aligned.html").read_text()
    assert 'href="r/vllm-1.html"' in index and 'href="r/vllm-1.html"' not in aligned.split('id="reports"')[0]
    assert 'href="r/vllm-2.html"' in aligned and 'href="r/sglang-2.html"' in aligned
    assert json.loads((out / "scoreboard.json").read_text())["aligned_suite_versions"] == ["0.2.0"]


@pytest.fixture
def vendor(tmp_path):
    return R.keypair(tmp_path / "keyring")


def _edit_after_signing(data):
    data["records"][1]["phases"] = R.OK  # the failure made a pass
    return data


def test_integrity_says_signed_unsigned_unknown_key_and_tampered(tmp_path, vendor):
    private, public = vendor
    other, _ = R.keypair(tmp_path / "other", "other")
    rechecksummed = _edit_after_signing(R.signed(R.report(), private))
    from lora_conformance.report.document import report_digest

    rechecksummed["digest"] = report_digest(rechecksummed)  # what anyone editing a report can recompute
    root = _tree(tmp_path, {
        "signed.json.xz": R.signed(R.report(), private), "unsigned.json": R.report(),
        "other.json": R.signed(R.report(), other), "edited.json": _edit_after_signing(R.signed(R.report(), private)),
        "rechecksummed.json": rechecksummed,
    })
    keys = integrity.load_keys(public.parent)
    got = {p.name: integrity.check(p, keys)[2] for p in integrity.report_files(root)}
    assert (got["signed.json.xz"].level, got["signed.json.xz"].key_name) == ("verified", "vendor")
    assert (got["unsigned.json"].signature, got["unsigned.json"].level) == ("unsigned", "unverified")
    assert got["other.json"].signature == "unknown key" and got["other.json"].level == "unverified"
    assert (got["edited.json"].digest, got["edited.json"].signature) == ("mismatch", "mismatch")
    assert got["rechecksummed.json"].digest == "ok" and got["rechecksummed.json"].level == "tampered"
    assert "changed after signing" in got["rechecksummed.json"].signature_detail


def test_a_tampered_report_is_shown_marked_never_hidden(tmp_path, vendor):
    private, public = vendor
    root = _tree(tmp_path, {"good.json": R.signed(R.report(engine="sglang"), private),
                            "edited.json": _edit_after_signing(R.signed(R.report(), private))})
    (root / "junk.json").write_text("{not json")
    out = tmp_path / "site"
    b = build.read_board(root, public.parent)
    build.write_site(b, out)
    index = (out / "index.html").read_text()
    edited = next(e for e in b.entries if e.rel == "edited.json")
    assert edited.integrity.level == "tampered" and edited in b.columns
    assert 'class="col integrity-tampered"' in index and 'class="col integrity-verified"' in index
    assert "junk.json" in index and b.unreadable[0][0] == "junk.json"  # unreadable: listed, with its error
    page = (out / "r" / "edited.html").read_text()
    assert "does not match its digest" in page and 'sb-banner integrity-tampered' in page
    assert (out / "r" / "edited.json").read_bytes() == (root / "edited.json").read_bytes()  # re-verifiable


def test_a_schema_1_report_reads_as_legacy_and_one_without_a_checksum_as_missing(tmp_path):
    from lora_conformance.report.legacy import SCHEMA_1, records_digest

    recs = R.records()
    legacy = {"schema": SCHEMA_1, "environment": R.environment(), "records": recs, "verdict": {},
              "records_digest": records_digest(recs)}
    root = _tree(tmp_path, {"legacy.json": legacy,
                            "bare.json": {k: v for k, v in legacy.items() if k != "records_digest"}})
    b = build.read_board(root)
    states = {e.rel: e.integrity.digest for e in b.entries}
    assert states == {"legacy.json": "legacy", "bare.json": "missing"}
    assert all(e.mode == "open" and e.suite_version == "0.1.0" for e in b.entries)


def test_revoked_reports_are_struck_through_with_their_reason(tmp_path):
    data = R.report()
    root = _tree(tmp_path, {"r.json": data, "kept.json": R.report(engine="sglang")})
    (root / "revoked.toml").write_text(f'[[revoked]]\ndigest = "{data["digest"]["sha256"]}"\n'
                                       'reason = "ran a patched engine build"\n\n'
                                       f'[[revoked]]\ndigest = "{"0" * 64}"\nreason = "an old one"\n')
    out = tmp_path / "site"
    assert scoreboard_cli.run(argparse.Namespace(reports=root, output=out, keys=None, revoked=None)) == 0
    b = build.read_board(root, revoked_path=root / "revoked.toml")
    assert {e.rel: e.revoked for e in b.entries} == {"kept.json": None, "r.json": "ran a patched engine build"}
    assert b.unmatched_revocations == {"0" * 64: "an old one"}
    index = (out / "index.html").read_text()
    assert 'integrity-unverified revoked"' in index and "revoked: ran a patched engine build" in index
    assert "Revocations that match no report here" in index


@pytest.mark.parametrize("text, words", [
    ('[[revoked]]\ndigest = "abc"\nreason = "x"\n', "entry 1: field 'digest' must be the report's sha256"),
    (f'[[revoked]]\ndigest = "{"a" * 64}"\n', "entry 1: field 'reason' is missing"),
    (f'[[revoked]]\ndigest = "{"a" * 64}"\nreason = "x"\nby = "me"\n', "entry 1: unknown field(s) by"),
    ("[revoke]\n", "unknown table(s) revoke"),
    ("[[revoked]\n", "cannot read the revocation list"),
])
def test_a_malformed_revocation_list_is_an_error_naming_the_entry_and_field(tmp_path, text, words):
    path = tmp_path / "revoked.toml"
    path.write_text(text)
    with pytest.raises(integrity.RevocationListError, match=None) as exc:
        integrity.load_revoked(path)
    assert str(path) in str(exc.value) and words in str(exc.value)


@pytest.mark.parametrize("bad, words", [
    ("key", "not a PEM public key"), ("revoked", "entry 1: field 'reason' is missing"),
    ("output", "exists and is not a directory"), ("keys option", "no such file or directory"),
])
def test_scoreboard_bad_input_is_one_error_naming_the_file(tmp_path, capsys, bad, words):
    root = _tree(tmp_path, {"a.json": R.report()})
    args = argparse.Namespace(reports=root, output=tmp_path / "site", keys=None, revoked=None)
    if bad == "key":
        (root / "keys").mkdir()
        (root / "keys" / "vendor.pub").write_text("not a key")
        named = root / "keys" / "vendor.pub"
    elif bad == "revoked":
        named = root / "revoked.toml"
        named.write_text(f'[[revoked]]\ndigest = "{"a" * 64}"\n')
    elif bad == "output":
        named = args.output
        named.write_text("a file, not a directory")
    else:
        named = args.keys = tmp_path / "nope"
    assert scoreboard_cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("lora-conformance scoreboard: error: ") and str(named) in err and words in err, err


def test_the_stored_reports_build(tmp_path):
    """``scoreboard reports/`` reads every stored report, of every age and schema: none unreadable,
    each checked, the one committed with a digest mismatch marked tampered, schema 1 ones legacy."""
    from test_report_digest import DIGEST_MISMATCH_AS_COMMITTED

    b = build.read_board(REPO / "reports")
    build.write_site(b, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    assert all(f'href="r/{e.slug}.html">{e.rel}</a>' in index for e in b.entries)
    assert all((tmp_path / "site" / "r" / f"{e.slug}.html").exists() for e in b.entries)
    assert not b.unreadable and len(b.entries) == len(integrity.report_files(REPO / "reports")) > 10
    for e in b.entries:
        assert (e.integrity.digest == "mismatch") == (e.rel in DIGEST_MISMATCH_AS_COMMITTED), e.rel
        assert e.integrity.digest in ("ok", "legacy", "missing", "mismatch") and e.cells, e.rel
        assert e.stored_verdict_same, e.rel
    assert any(e.integrity.digest == "legacy" for e in b.entries)
    assert {c.engine for c in b.columns} >= {"builtin", "vllm", "sglang"}


# ---- submit ---------------------------------------------------------------------------------------


def _submit(report_path, key, out):
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    return submit.run(parser.parse_args([str(report_path), "--key", str(key), "-o", str(out)]))


@pytest.mark.parametrize("case, words", [
    ("open", "not a certified-mode run"),
    ("unsigned", "not signed: sign it with 'lora-conformance report sign"),
    ("other key", "the signature does not verify with"),
    ("edited", "the signature does not verify with"),
    ("verdict", "the stored verdict differs from the one its records give"),
    ("missing", "cannot read a report"),
])
def test_submit_refuses_with_one_line_saying_why(tmp_path, vendor, capsys, case, words):
    private, public = vendor
    other, _ = R.keypair(tmp_path / "other", "other")
    data = {"open": lambda: R.signed(R.report("open"), private), "unsigned": lambda: R.report(),
            "other key": lambda: R.signed(R.report(), other),
            "edited": lambda: _edit_after_signing(R.signed(R.report(), private)),
            "verdict": lambda: R.signed({**R.report(), "verdict": {"summary": {"certified": True}}}, private),
            "missing": lambda: None}[case]()
    path = tmp_path / "report.json"
    if data is not None:
        if case == "verdict":
            from lora_conformance.report.document import report_digest

            data = R.signed({**data, "digest": report_digest(data)}, private)
        R.store(data, path)
    out = tmp_path / "submission"
    assert _submit(path, public, out) == submit.REFUSED_EXIT
    err = capsys.readouterr().err
    assert err.startswith("lora-conformance submit: refused: ") and words in err and err.count("\n") == 1, err
    assert not out.exists()


def test_submit_writes_what_a_pull_request_needs(tmp_path, vendor):
    private, public = vendor
    data = R.signed(R.report(), private)
    path = R.store(data, tmp_path / "run" / "report.json")
    out = tmp_path / "submission"
    assert _submit(path, public, out) == 0
    [manifest_path] = (out / "reports").glob("*.manifest.json")
    m = json.loads(manifest_path.read_text())
    assert (m["engine"], m["device"], m["dtype"], m["suite_version"]) == ("vllm", "cuda", "bfloat16", "0.1.0")
    assert m["counts"] == {"passed": 1, "waived": 1, "failed": 1, "not certified": 1, "features": 4}
    assert m["digest"] == data["digest"]["sha256"] and m["badge"] == "1 passed, 1 waived / 4"
    stored = out / "reports" / m["report"]
    sig = json.loads((out / "reports" / m["report"].replace(".json.xz", ".signature.json")).read_text())
    assert sig["value"] == data["signature"]["value"] and sig["report"] == m["report"]
    key = out / "reports" / "keys" / f"{m['key_id']}.pub"
    assert key.read_bytes() == public.read_bytes()
    # What is submitted verifies as the original did, and the scoreboard shows it verified.
    assert integrity.check(stored, integrity.load_keys(key.parent))[2].level == "verified"
    b = build.read_board(out / "reports")
    assert [e.integrity.level for e in b.entries] == ["verified"]  # the manifest and signature are no reports
    pr = (out / "PULL_REQUEST.md").read_text()
    assert pr.startswith("# Certification: vllm on cuda (bfloat16), suite 0.1.0")
    assert "**1 passed, 1 waived / 4**" in pr and R.ISSUE in pr and m["digest"] in pr


def test_the_workflow_builds_the_site_from_reports_and_deploys_it_as_a_pages_artifact():
    yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the workflows (pip install pyyaml)")
    wf = yaml.safe_load((REPO / "ci" / "workflows" / "scoreboard.yml").read_text())
    build_job, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    runs = [s.get("run") or "" for s in build_job["steps"]]
    assert "lora-conformance scoreboard reports/ -o site/" in runs
    [upload] = [s for s in build_job["steps"] if str(s.get("uses", "")).startswith("actions/upload-pages-artifact@")]
    assert upload["with"]["path"] == "site/"
    assert deploy["needs"] == "build" and "pull_request" in deploy["if"]  # a submission builds, main deploys
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert [s["uses"].split("@")[0] for s in deploy["steps"]] == ["actions/deploy-pages"]
    parser = argparse.ArgumentParser()
    scoreboard_cli.add_arguments(parser)
    args = parser.parse_args(runs[runs.index("lora-conformance scoreboard reports/ -o site/")].split()[2:])
    assert (args.reports, args.output) == (Path("reports"), Path("site"))
