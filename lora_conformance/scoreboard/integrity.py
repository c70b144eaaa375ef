"""Whether a stored report is what its run wrote: its digest, its signature, and whether it was revoked.

Reading goes through the report's own loaders (``document.load_report``: format, schema, digest;
``legacy`` for schema 1) and ``signing.verify_signature``; this module only names the outcome,
so the scoreboard shows an unsigned, tampered or undigested report as such instead of failing or
hiding it:

- digest: ``ok`` (schema 2: covers environment, selection, records, verdict, certification),
  ``legacy`` (schema 1: a checksum of the records only), ``missing``, ``mismatch``;
- signature: ``ok`` (by a key in the scoreboard's key directory), ``unsigned``, ``unknown key``
  (signed, but by no key the scoreboard knows), ``mismatch`` (changed after signing, or a malformed
  signature), ``not checked`` (the ``cryptography`` package is not installed).

A signature is checked over the report as stored (``signing.canonical_bytes`` of the raw JSON).
Revocations are ``revoked.toml`` entries (``[[revoked]]`` with ``digest`` and ``reason``) matched on
the digest the report carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from lora_conformance.report.document import ReportDigestError, ReportFormatError

# Files beside the reports that a submission writes and that are not reports.
NOT_REPORTS = (".manifest.json", ".signature.json")
REPORT_SUFFIXES = (".json", ".json.xz", ".json.gz")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Integrity:
    digest: str  # ok | legacy | missing | mismatch
    signature: str  # ok | unsigned | unknown key | mismatch | not checked
    key_id: Optional[str] = None
    key_name: Optional[str] = None  # the key file's stem in the key directory
    digest_detail: str = ""  # the loader's own words, when the digest is missing or does not match
    signature_detail: str = ""  # the signature check's own words, when it did not pass

    @property
    def detail(self) -> str:
        return "; ".join(d for d in (self.digest_detail, self.signature_detail) if d)

    @property
    def tampered(self) -> bool:
        """Edited after the run (digest) or after signing (signature)."""
        return self.digest == "mismatch" or self.signature == "mismatch"

    @property
    def level(self) -> str:
        """``verified`` (signed by a known key, digest ok), ``tampered``, or ``unverified``."""
        if self.tampered:
            return "tampered"
        return "verified" if self.signature == "ok" and self.digest == "ok" else "unverified"

    def words(self) -> str:
        digest = {"ok": "digest ok", "legacy": "schema 1: records checksum ok, environment not covered",
                  "missing": "no digest", "mismatch": "does not match its digest"}[self.digest]
        signature = {"ok": f"signed by {self.key_name or self.key_id}", "unsigned": "unsigned",
                     "unknown key": f"signed by unknown key {self.key_id}",
                     "mismatch": "signature does not match", "not checked": "signature not checked"}[self.signature]
        return f"{signature}; {digest}"


def report_files(root: Path) -> list[Path]:
    """Every stored report under ``root`` (``.json``, ``.json.xz``, ``.json.gz``), keys and
    submission manifests aside, in path order."""
    root = Path(root)
    found = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(REPORT_SUFFIXES)
             and not p.name.endswith(NOT_REPORTS) and "keys" not in p.relative_to(root).parts[:-1]]
    return sorted(found)


def read_raw(path: Path) -> dict[str, Any]:
    """The report as stored (what its signature covers)."""
    from lora_conformance.fileio import read_report_object

    return read_report_object(path, ReportFormatError)[1]


def stored_digest(raw: Mapping[str, Any]) -> Optional[str]:
    """The digest the report carries (schema 2's sha256, schema 1's records checksum), as stored."""
    digest = raw.get("digest")
    if isinstance(digest, Mapping) and isinstance(digest.get("sha256"), str):
        return digest["sha256"]
    return raw.get("records_digest") if isinstance(raw.get("records_digest"), str) else None


def load_checked(path: Path) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """(raw, loaded report, digest state, the loader's words): a report that does not match its digest
    is still read, and says so. A report that cannot be read at all raises ReportFormatError."""
    from lora_conformance.report.document import load_report

    raw = read_raw(path)
    try:
        report = load_report(path)
        return raw, report, ("legacy" if report.get("legacy") else "ok"), ""
    except ReportDigestError as exc:
        report = load_report(path, check_digest=False)
        return raw, report, ("mismatch" if stored_digest(raw) else "missing"), str(exc)


def load_keys(directory: Optional[Path]) -> dict[str, tuple[str, Any]]:
    """key id -> (name, public key) of every ``*.pub`` (PEM, Ed25519) in ``directory``."""
    if directory is None or not Path(directory).is_dir():
        return {}
    return load_keys_from(sorted(Path(directory).glob("*.pub")))


def load_keys_from(paths) -> dict[str, tuple[str, Any]]:
    """key id -> (name, public key) of these public key files; SignatureError names a bad one."""
    from lora_conformance.report import signing

    keys = {}
    for path in paths:
        key = signing._load_key(Path(path), private=False)
        keys[signing.key_id(key)] = (Path(path).stem, key)
    return keys


def signature_state(raw: Mapping[str, Any],
                    keys: Mapping[str, tuple[str, Any]]) -> tuple[str, Optional[str], Optional[str], str]:
    """(state, key id, key name, detail) of ``raw``'s signature against the known ``keys``."""
    from lora_conformance.report import signing

    sig = raw.get(signing.SIGNATURE_FIELD)
    if sig is None:
        return "unsigned", None, None, ""
    kid = sig.get("key_id") if isinstance(sig, Mapping) and isinstance(sig.get("key_id"), str) else None
    if kid is not None and kid not in keys:
        known = ", ".join(keys) or "none given"
        return "unknown key", kid, None, f"signed with key {kid}, which is none of the known keys ({known})"
    name, key = keys.get(kid, (None, None)) if kid else (None, None)
    if key is None:
        return "mismatch", kid, None, "'signature' is not a signature object with a key id"
    try:
        signing.verify_signature(raw, key)
    except signing.SignatureError as exc:
        if "cryptography" in str(exc):
            return "not checked", kid, name, str(exc)
        return "mismatch", kid, name, str(exc)
    return "ok", kid, name, ""


def check(path: Path, keys: Mapping[str, tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], Integrity]:
    """(raw, loaded report, integrity) of one stored report."""
    raw, report, digest, detail = load_checked(path)
    state, kid, name, sig_detail = signature_state(raw, keys)
    return raw, report, Integrity(digest, state, kid, name, detail.split("; pass --ignore-digest")[0], sig_detail)


# ---- revocations --------------------------------------------------------------------------------

class RevocationListError(ValueError):
    pass


def load_revoked(path: Optional[Path]) -> dict[str, str]:
    """digest -> reason from ``revoked.toml`` (``[[revoked]]`` entries with ``digest`` and ``reason``);
    none where there is no file. A malformed file is an error naming the entry and the field."""
    import tomllib

    if path is None or not Path(path).exists():
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RevocationListError(f"{path}: cannot read the revocation list: {exc}") from None
    unknown = set(data) - {"revoked"}
    if unknown:
        raise RevocationListError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}; "
                                  "expected [[revoked]] entries")
    entries = data.get("revoked", [])
    if not isinstance(entries, list):
        raise RevocationListError(f"{path}: 'revoked' must be an array of tables ([[revoked]])")
    out: dict[str, str] = {}
    for i, entry in enumerate(entries, start=1):
        where = f"{path}: entry {i}"
        extra = set(entry) - {"digest", "reason", "date"}
        if extra:
            raise RevocationListError(f"{where}: unknown field(s) {', '.join(sorted(extra))} "
                                      "(expected digest, reason and optionally date)")
        digest, reason = entry.get("digest"), entry.get("reason")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise RevocationListError(f"{where}: field 'digest' must be the report's sha256 digest (64 lowercase "
                                      f"hex digits, its 'digest.sha256'), got {digest!r:.80}")
        if not isinstance(reason, str) or not reason.strip():
            raise RevocationListError(f"{where}: field 'reason' is missing or empty; a revocation says why")
        if digest in out:
            raise RevocationListError(f"{where}: digest {digest[:16]}... is revoked twice")
        out[digest] = reason.strip()
    return out
