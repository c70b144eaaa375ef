"""``lora-conformance report merge|render``: work on report.json files without rerunning."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="report_command", required=True, metavar="ACTION")
    m = sub.add_parser("merge", help="merge reports into one engine x device matrix (report.md/html/json)")
    m.add_argument("reports", nargs="+", type=Path, help="report.json files (or directories holding one)")
    m.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    r = sub.add_parser("render", help="re-verify one report.json and write report.md/html/json and badge.svg")
    r.add_argument("report", type=Path, help="a report.json (or a directory holding one)")
    r.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    v = sub.add_parser("verify", help="check one report.json (format, digest) and print its re-verified verdict")
    v.add_argument("report", type=Path, help="a report.json (or a directory holding one)")
    for p in (m, r, v):
        p.add_argument("--ignore-digest", action="store_true",
                       help="read reports that do not match their digest (edited or damaged reports)")
    from lora_conformance.report import signing

    signing.add_arguments(sub, v)  # keygen, sign, verify --key

DIGEST_EXIT = 3  # the report does not match its digest (2: any other unreadable report)


def _digest_words(report, checked: bool) -> str:
    if not checked:
        return "digest not checked (--ignore-digest)"
    if report.get("unverified"):
        return f"digest ok, but {report['unverified']}"
    if report.get("legacy"):
        return ("records checksum ok (schema 1: its checksum covers the records only; the environment is "
                "covered by no digest and the selection was not recorded)")
    return "digest ok (covers environment, selection, records and verdict)"


def _verdict_words(report, verdict) -> str:
    from lora_conformance.report.selection import narrowing

    passed, counted = verdict.score()
    words = f"{verdict.status_text()}: {passed}/{counted} features pass"
    narrowed = narrowing(report.get("selection"))
    if verdict.partial:
        words += (f" (selected by {', '.join(narrowed)})" if narrowed else "") + "; a partial run certifies nothing"
    return words


def run(args) -> int:
    from lora_conformance.report.document import (ReportDigestError, ReportFormatError, load_report, reverify,
                                                  write_report)
    from lora_conformance.report.merge import MergeConflict, merge, write_matrix

    from lora_conformance.report import signing

    signed = signing.run(args)  # keygen, sign, and the signature half of verify --key
    if signed is not None:
        return signed
    check = not getattr(args, "ignore_digest", False)
    try:
        if args.report_command == "merge":
            matrix = merge([load_report(p, check_digest=check) for p in args.reports])
            paths = write_matrix(matrix, args.output)
            print(f"merged {len(args.reports)} report(s) into {len(matrix['columns'])} column(s): "
                  f"{', '.join(c['key'] + ' ' + c['score'] + ' (' + c['status'] + ')' for c in matrix['columns'])}")
            print(f"wrote {paths['report.html']}")
            return 0
        report = load_report(args.report, check_digest=check)
        verdict, same = reverify(report)
        if args.report_command == "verify":
            print(f"{args.report}: format ok, {_digest_words(report, check)}; stored verdict "
                  f"{'matches' if same else 'DIFFERS from'} the records")
            print(_verdict_words(report, verdict))
            return 0 if same else 1
        if not same:
            # Rules changed since the run (or the file was edited): the records decide.
            print("note: the stored verdict differs from the re-verified one; writing the re-verified verdict",
                  file=sys.stderr)
        if not check:
            report = {**report, "unverified": report.get("unverified") or
                      f"rendered with --ignore-digest from {args.report}: its digest was not checked"}
        paths = write_report(report, args.output)
        print(_verdict_words(report, verdict))
        print(f"wrote {paths['report.html']}")
        return 0
    except ReportDigestError as exc:
        print(f"lora-conformance report: error: {exc}", file=sys.stderr)
        return DIGEST_EXIT
    except (ReportFormatError, MergeConflict, OSError) as exc:
        print(f"lora-conformance report: error: {exc}", file=sys.stderr)
        return 2
