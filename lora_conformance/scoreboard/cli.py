"""``lora-conformance scoreboard REPORTS -o SITE``: the static scoreboard site of a directory of reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", type=Path, help="a directory of stored reports (.json, .json.xz, .json.gz; "
                        "searched recursively)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the site's directory (static files)")
    parser.add_argument("--keys", type=Path, default=None,
                        help="a directory of vendors' public keys (*.pub, PEM); default: REPORTS/keys")
    parser.add_argument("--revoked", type=Path, default=None,
                        help="the revocation list ([[revoked]] digest, reason); default: REPORTS/revoked.toml")


def run(args) -> int:
    from lora_conformance.report.signing import SignatureError
    from lora_conformance.scoreboard.build import read_board, write_site
    from lora_conformance.scoreboard.integrity import RevocationListError

    for given in (args.keys, args.revoked):
        if given is not None and not given.exists():
            print(f"lora-conformance scoreboard: error: {given}: no such file or directory", file=sys.stderr)
            return 2
    try:
        b = read_board(args.reports, args.keys, args.revoked)
        paths = write_site(b, args.output)
    except (OSError, RevocationListError, SignatureError) as exc:
        print(f"lora-conformance scoreboard: error: {exc}", file=sys.stderr)
        return 2
    levels = {}
    for e in b.entries:
        levels[e.integrity.level] = levels.get(e.integrity.level, 0) + 1
    print(f"read {len(b.entries)} report(s) ({', '.join(f'{n} {k}' for k, n in sorted(levels.items())) or 'none'}), "
          f"{len(b.unreadable)} unreadable, {sum(1 for e in b.entries if e.revoked)} revoked; "
          f"{len(b.columns)} column(s) in the matrix")
    for rel, err in b.unreadable:
        print(f"  unreadable: {err}", file=sys.stderr)
    for digest in b.unmatched_revocations:
        print(f"  note: revoked.toml names digest {digest[:16]}..., which no report here has", file=sys.stderr)
    print(f"wrote {paths['index.html']}")
    return 0
