"""``lora-conformance scoreboard REPORTS -o SITE``: read every stored report, check it, write the site.

The site is static files only (nothing fetched, no external script or style):

- ``index.html``: the matrix (features x products at each suite version), filters, a legend, and
  every report read (the superseded ones too, and the files that could not be read at all);
- ``aligned.html``: the same, with only the suite versions every product ran;
- ``r/<slug>.html``: each report's own page (``report.html``'s rendering) under a banner that
  states its integrity, revocation and certification; ``r/<slug>.<suffix>``: the stored file, so
  anyone can re-verify it;
- ``scoreboard.json``: the columns and cells, for tools; ``scoreboard.css``, ``scoreboard.js``.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lora_conformance.scoreboard import board, integrity

ASSETS = ("scoreboard.css", "scoreboard.js")


@dataclass
class Board:
    entries: list  # board.Entry, every report read, in path order
    columns: list  # the entries shown in the matrix
    unreadable: list = field(default_factory=list)  # (relative path, error)
    unmatched_revocations: dict = field(default_factory=dict)  # digest -> reason, naming no report read
    reports_dir: str = ""


def slug_of(rel: str) -> str:
    stem = re.sub(r"\.json(\.xz|\.gz)?$", "", rel)
    return re.sub(r"[^A-Za-z0-9_.-]+", "--", stem).strip("-.") or "report"


def read_board(reports_dir: Path, keys_dir: Optional[Path] = None, revoked_path: Optional[Path] = None) -> Board:
    """Every report under ``reports_dir`` read and checked; a report that cannot be read is listed as
    such, one that does not match its digest or signature is read and marked. The keys default to
    ``reports_dir/keys``, the revocation list to ``reports_dir/revoked.toml`` (either may be absent)."""
    from lora_conformance.report.document import ReportFormatError, reverify

    reports_dir = Path(reports_dir)
    if not reports_dir.is_dir():
        raise FileNotFoundError(f"{reports_dir}: no such directory of reports")
    keys = integrity.load_keys(reports_dir / "keys" if keys_dir is None else keys_dir)
    revoked = integrity.load_revoked(reports_dir / "revoked.toml" if revoked_path is None else revoked_path)
    entries, unreadable, slugs = [], [], set()
    for path in integrity.report_files(reports_dir):
        rel = path.relative_to(reports_dir).as_posix()
        try:
            raw, report, checked = integrity.check(path, keys)
        except ReportFormatError as exc:
            unreadable.append((rel, str(exc)))
            continue
        slug = slug_of(rel)
        while slug in slugs:
            slug += "-"
        slugs.add(slug)
        verdict, same = reverify(report)
        entry = board.Entry(path, rel, slug, raw, report, verdict, same, checked)
        entry.revoked = revoked.get(entry.digest or "")
        entry.cells = board.feature_cells(report, verdict)
        entries.append(entry)
    matched = {e.digest for e in entries}
    return Board(entries, board.choose_columns(entries), unreadable,
                 {d: r for d, r in revoked.items() if d not in matched}, str(reports_dir))


def board_json(b: Board) -> dict:
    return {"schema": "lora-conformance/scoreboard/1", "columns": [{
        "report": c.rel, "engine": c.engine, "engine_version": c.engine_version, "variant": c.variant,
        "device": c.device, "dtype": c.dtype, "suite_version": c.suite_version, "mode": c.mode, "date": c.date,
        "digest": c.digest, "integrity": c.integrity.level, "integrity_words": c.integrity.words(),
        "revoked": c.revoked, "counts": c.counts, "certified": c.verdict.certified,
        "cells": {fid: cell.status for fid, cell in c.cells.items()}} for c in b.columns],
        "aligned_suite_versions": sorted(board.aligned_versions(b.columns)),
        "superseded": {e.rel: e.superseded_by for e in b.entries if e.superseded_by},
        "unreadable": dict(b.unreadable)}


def write_site(b: Board, out_dir: Path) -> dict[str, Path]:
    from lora_conformance.scoreboard import site

    def write(path: Path, text: str) -> None:  # plain files: a Pages artifact wants them world-readable
        path.write_text(text, encoding="utf-8")

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: exists and is not a directory; the site is a directory of files")
    (out_dir / "r").mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    for name in ASSETS:
        shutil.copyfile(here / name, out_dir / name)
    paths = {"index.html": out_dir / "index.html", "aligned.html": out_dir / "aligned.html",
             "scoreboard.json": out_dir / "scoreboard.json"}
    write(paths["index.html"], site.index_page(b, aligned=False))
    write(paths["aligned.html"], site.index_page(b, aligned=True))
    write(paths["scoreboard.json"], json.dumps(board_json(b), indent=1) + "\n")
    for e in b.entries:
        shutil.copyfile(e.path, out_dir / "r" / (e.slug + site.stored_suffix(e)))
        write(out_dir / "r" / f"{e.slug}.html", site.report_page(e))
    return paths
