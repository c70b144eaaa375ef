"""``lora-conformance submit REPORT --key vendor.pub [-o DIR]``: a certification, ready for a pull request
to a scoreboard repository (docs/certifying.md).

A report is refused, with one line saying why, unless it is a certified-mode run, signed, and
verifies as ``report verify --key`` checks it: the signature by the given public key, the digest,
and a stored verdict that its records still give. Otherwise DIR receives what the pull request adds:

- ``reports/<name>.json.xz``: the report, stored compactly (``fileio.store_report``; its digest and
  signature cover canonical forms, so both still verify);
- ``reports/<name>.signature.json``: its signature object, for a reviewer or a bot to read;
- ``reports/<name>.manifest.json``: engine, version, device, dtype, suite version, feature counts
  (passed, waived, failed, not certified), digest, key id;
- ``reports/keys/<key id>.pub``: the public key it verifies with;
- ``PULL_REQUEST.md``: the pull request's title and description.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping

MANIFEST_SCHEMA = "lora-conformance/submission/1"
REFUSED_EXIT = 2


class Refused(Exception):
    """The report cannot be submitted; the message is the one-line reason."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", type=Path, help="a signed certified-mode report (.json, .json.xz, .json.gz, "
                        "or a directory holding report.json)")
    parser.add_argument("--key", type=Path, required=True,
                        help="the public key (PEM) the report was signed with; it goes into the submission")
    parser.add_argument("-o", "--output", type=Path, default=Path("submission"),
                        help="where to write the pull request's files (default: ./submission)")


def checked(path: Path, key_path: Path):
    """(loaded report, verdict, integrity) of a report fit to submit; Refused says why not."""
    from lora_conformance.report.document import ReportFormatError, reverify
    from lora_conformance.report.signing import SignatureError
    from lora_conformance.scoreboard.board import mode_of
    from lora_conformance.scoreboard.integrity import check, load_keys_from

    try:
        keys = load_keys_from([key_path])
        raw, report, integrity = check(path, keys)
    except (ReportFormatError, SignatureError) as exc:
        raise Refused(str(exc)) from None
    if mode_of(report) != "certified":
        raise Refused(f"{path}: not a certified-mode run (an open run certifies nothing to publish): run "
                      "'lora-conformance certify --certified' and sign its report")
    if integrity.signature == "unsigned":
        raise Refused(f"{path}: not signed: sign it with 'lora-conformance report sign {path} --key vendor.key'")
    if integrity.signature != "ok":
        raise Refused(f"{path}: the signature does not verify with {key_path}: {integrity.signature_detail}")
    if integrity.digest != "ok":
        raise Refused(integrity.digest_detail or f"{path}: {integrity.words()}")
    verdict, same = reverify(report)
    if not same:
        raise Refused(f"{path}: the stored verdict differs from the one its records give (edited, or written by "
                      "other rules): re-run the certification")
    return raw, report, verdict, integrity


def manifest(report: Mapping[str, Any], verdict, integrity, name: str) -> dict[str, Any]:
    from lora_conformance.scoreboard import board

    env = report.get("environment") or {}
    c = board.counts(board.feature_cells(report, verdict).values())
    return {"schema": MANIFEST_SCHEMA, "report": f"{name}.json.xz",
            "engine": (env.get("engine") or {}).get("name"), "version": (env.get("engine") or {}).get("version"),
            "variant": board.variant_of((env.get("engine") or {}).get("args") or {}),
            "device": (env.get("device") or {}).get("type"),
            "device_name": (env.get("device") or {}).get("device_name"),
            "dtype": env.get("dtype"), "suite_version": board.suite_version_of(report), "date": env.get("date"),
            "counts": {"passed": c["passed"], "waived": c["waived"], "failed": c["failed"] + c["error"],
                       "not certified": c["not certified"], "features": c["counted"]},
            "badge": board.count_text(c, "certified"), "certified": verdict.certified,
            "digest": (report.get("digest") or {}).get("sha256"), "key_id": integrity.key_id}


def description(m: Mapping[str, Any], report: Mapping[str, Any]) -> str:
    cert = report.get("certification") or {}
    audit = cert.get("audit") or {}
    lines = [f"# Certification: {m['engine']}{' (' + m['variant'] + ')' if m['variant'] else ''} on {m['device']} "
             f"({m['dtype']}), suite {m['suite_version']}", "",
             f"- engine: `{m['engine']}`, version {m['version'] or 'not recorded'}",
             f"- device: {m['device']}{' (' + str(m['device_name']) + ')' if m.get('device_name') else ''}, "
             f"dtype {m['dtype']}",
             f"- suite version: {m['suite_version']} (certified mode), run {m['date'] or 'at an unrecorded date'}",
             f"- result: **{m['badge']}**, {'certified' if m['certified'] else 'not certified'} "
             f"({m['counts']['failed']} failed, {m['counts']['not certified']} not certified)",
             f"- waivers from: {cert.get('expectations') or 'no expectations file'}",
             f"- audit: {int(audit.get('sampled') or 0)} passed cases asked again, "
             f"{len(audit.get('mismatches') or ())} different",
             f"- digest: `{m['digest']}`", f"- signed with key `{m['key_id']}` (`reports/keys/{m['key_id']}.pub`: "
             "a key new to the scoreboard needs a maintainer to confirm it is the vendor's)", ""]
    waived = [w for w in cert.get("waived") or () if isinstance(w, Mapping)]
    if waived:
        lines += ["## Waivers", "", "| case | issue | recorded against | re-confirmed |", "| --- | --- | --- | --- |"]
        again = {True: "yes", False: "no: it no longer fails", None: "not needed"}
        lines += [f"| `{w.get('nodeid')}` | {w.get('issue')} | {w.get('recorded_against')} | "
                  f"{again.get(w.get('reconfirmed'), '?')} |" for w in waived]
        lines.append("")
    lines += ["## What the scoreboard's CI checks again", "", "```",
              f"lora-conformance report verify reports/{m['report']} --key reports/keys/{m['key_id']}.pub",
              "lora-conformance scoreboard reports/ -o site/", "```", ""]
    return "\n".join(lines)


def write_submission(path: Path, key_path: Path, out: Path) -> dict[str, Path]:
    from lora_conformance.fileio import store_report

    raw, report, verdict, integrity = checked(path, key_path)
    env = report.get("environment") or {}
    from lora_conformance.scoreboard.board import suite_version_of, variant_of

    parts = [(env.get("engine") or {}).get("name"), variant_of((env.get("engine") or {}).get("args") or {}),
             (env.get("device") or {}).get("type"), env.get("dtype"), "suite" + suite_version_of(report),
             report["digest"]["sha256"][:12]]
    name = re.sub(r"[^A-Za-z0-9_.]+", "-", "-".join(str(p) for p in parts if p)).strip("-")
    (out / "reports" / "keys").mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "reports" / f"{name}.json.xz", "signature": out / "reports" / f"{name}.signature.json",
             "manifest": out / "reports" / f"{name}.manifest.json",
             "key": out / "reports" / "keys" / f"{integrity.key_id}.pub", "description": out / "PULL_REQUEST.md"}
    store_report(path, paths["report"])
    checked(paths["report"], key_path)  # what is submitted verifies as the original did
    m = manifest(report, verdict, integrity, name)
    paths["signature"].write_text(json.dumps({"report": m["report"], **raw["signature"]}, indent=1) + "\n")
    paths["manifest"].write_text(json.dumps(m, indent=1) + "\n")
    shutil.copyfile(key_path, paths["key"])
    paths["description"].write_text(description(m, report))
    return paths


def run(args) -> int:
    try:
        paths = write_submission(args.report, args.key, args.output)
    except Refused as exc:
        print(f"lora-conformance submit: refused: {exc}", file=sys.stderr)
        return REFUSED_EXIT
    except OSError as exc:  # the output directory cannot be written
        print(f"lora-conformance submit: error: {exc}", file=sys.stderr)
        return REFUSED_EXIT
    print(f"wrote {len(paths)} files under {args.output}: open a pull request to the scoreboard repository with "
          f"them; its description is {paths['description']}")
    return 0
