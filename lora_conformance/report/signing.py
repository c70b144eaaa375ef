"""Signed reports: an Ed25519 signature over a report's canonical bytes.

A digest tells whether a report was damaged; it cannot tell who wrote it, because anyone who edits
a report can recompute the digest. A signature can: the vendor (or the lab that ran the
certification) signs ``report.json`` with a private key, and anyone holding the matching public key
checks that not one byte of what a reader trusts (records, verdict, environment, selection,
versions: everything but the signature itself) changed since.

    lora-conformance report keygen --private vendor.key --public vendor.pub
    lora-conformance report sign lora-report/report.json --key vendor.key
    lora-conformance report verify lora-report/report.json --key vendor.pub

The signature is stored in the report under ``signature``: the algorithm, the public key's id
(sha256 of its raw bytes, first 16 hex digits: which key to ask for) and the signature (base64).
Verification uses the public key given to it, never one the report names. Signing needs the
``cryptography`` package (``pip install lora-conformance[sign]``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

SIGNATURE_FIELD = "signature"
ALGORITHM = "ed25519"
COVERS = "canonical JSON of the report without 'signature' (sorted keys, no whitespace, UTF-8)"


class SignatureError(ValueError):
    """A report's signature is missing, malformed, made with another key, or does not match."""


def canonical_bytes(report: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the report's own canonical form (everything but its digest,
    which is derived from the same bytes, and its signature)."""
    from lora_conformance.report.document import canonical_bytes as report_bytes

    return report_bytes(report)


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - an optional dependency
        raise SignatureError("signing reports needs the cryptography package: pip install "
                             "'lora-conformance[sign]' (or pip install cryptography)") from None
    return ed25519, serialization, InvalidSignature


def _raw_public(public_key) -> bytes:
    _, serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key) -> str:
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Write a new Ed25519 key pair as PEM files (the private one readable by its owner only);
    returns the key id. Refuses to overwrite an existing file."""
    ed25519, serialization, _ = _crypto()
    private_path, public_path = Path(private_path), Path(public_path)
    for p in (private_path, public_path):
        if p.exists():
            raise SignatureError(f"{p} exists; not overwriting a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_id(key.public_key())


def _load_key(path: Path, private: bool):
    ed25519, serialization, _ = _crypto()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"{path}: cannot read the key: {exc.strerror or exc}") from None
    try:
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as exc:
        want = "an unencrypted PEM private key" if private else "a PEM public key"
        raise SignatureError(f"{path}: not {want} ({exc})") from None
    want_type = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, want_type):
        raise SignatureError(f"{path}: an {type(key).__name__}; expected an Ed25519 key "
                             "(lora-conformance report keygen makes one)")
    return key


def _read(path: Path) -> tuple[Path, dict]:
    from lora_conformance.fileio import read_report_object

    return read_report_object(path, SignatureError)


def sign_report(report: Mapping[str, Any], private_key) -> dict:
    """``report`` with its signature (any earlier one replaced)."""
    body = {k: v for k, v in report.items() if k != SIGNATURE_FIELD}
    sig = private_key.sign(canonical_bytes(body))
    return {**body, SIGNATURE_FIELD: {"algorithm": ALGORITHM, "key_id": key_id(private_key.public_key()),
                                      "covers": COVERS, "value": base64.b64encode(sig).decode("ascii")}}


def verify_signature(report: Mapping[str, Any], public_key) -> str:
    """Raise SignatureError unless ``report`` carries a valid signature by ``public_key``; returns the key id."""
    _, _, InvalidSignature = _crypto()
    sig = report.get(SIGNATURE_FIELD)
    if sig is None:
        raise SignatureError("the report is not signed (no 'signature')")
    if not isinstance(sig, dict) or sig.get("algorithm") != ALGORITHM or not isinstance(sig.get("value"), str):
        raise SignatureError(f"'signature' is not an {ALGORITHM} signature object")
    want = key_id(public_key)
    if sig.get("key_id") != want:
        raise SignatureError(f"signed with key {sig.get('key_id')!r}, not with the given key {want!r}")
    try:
        raw = base64.b64decode(sig["value"], validate=True)
        public_key.verify(raw, canonical_bytes(report))
    except (ValueError, InvalidSignature):
        raise SignatureError(f"the signature by key {want} does not match the report: it was changed after "
                             "signing (records, verdict, environment, selection or versions)") from None
    return want


def sign_file(path: Path, private_key_path: Path, output: Path | None = None) -> tuple[Path, str]:
    path, data = _read(path)
    signed = sign_report(data, _load_key(private_key_path, private=True))
    out = Path(output) if output else path
    from lora_conformance.fileio import write_text_atomic

    write_text_atomic(out, json.dumps(signed, indent=1, sort_keys=True) + "\n")
    return out, signed[SIGNATURE_FIELD]["key_id"]


def verify_file(path: Path, public_key_path: Path) -> str:
    path, data = _read(path)
    try:
        return verify_signature(data, _load_key(public_key_path, private=False))
    except SignatureError as exc:
        raise SignatureError(f"{path}: {exc}") from None


# ---- command line (hooked into ``lora-conformance report``) ---------------------------------

SIGNATURE_EXIT = 5  # the signature is missing or does not verify with the given key


def add_arguments(sub, verify_parser) -> None:
    k = sub.add_parser("keygen", help="make an Ed25519 key pair for signing reports (PEM files)")
    k.add_argument("--private", type=Path, required=True, help="where to write the private key (mode 0600)")
    k.add_argument("--public", type=Path, required=True, help="where to write the public key")
    s = sub.add_parser("sign", help="sign a report.json with an Ed25519 private key")
    s.add_argument("report", type=Path, help="a report.json (or a directory holding one)")
    s.add_argument("--key", type=Path, required=True, help="the private key (PEM)")
    s.add_argument("-o", "--output", type=Path, default=None, help="write the signed report here (default: in place)")
    verify_parser.add_argument("--key", type=Path, default=None,
                               help="also check the report's signature with this public key (PEM)")


def run(args) -> int | None:
    """Handle keygen, sign and ``verify --key``'s signature check; None: not ours (or passed)."""
    import sys

    try:
        if args.report_command == "keygen":
            kid = generate_keypair(args.private, args.public)
            print(f"wrote {args.private} (private, keep it secret) and {args.public} (public); key id {kid}")
            return 0
        if args.report_command == "sign":
            out, kid = sign_file(args.report, args.key, args.output)
            print(f"signed {out} with key {kid}")
            return 0
        if args.report_command == "verify" and getattr(args, "key", None) is not None:
            kid = verify_file(args.report, args.key)
            print(f"{args.report}: signature ok (key {kid})")
    except SignatureError as exc:
        print(f"lora-conformance report: error: {exc}", file=sys.stderr)
        return SIGNATURE_EXIT if args.report_command == "verify" else 2
    return None
