"""The scoreboard: stored certification reports as one static site (docs/certifying.md).

- ``integrity``: each report's digest and signature checked, revocations (``revoked.toml``) read;
- ``board``: the model: entries, a cell per feature, products as columns, the aligned view;
- ``site``: the pages; ``build``: reading a directory of reports and writing the site;
- ``cli``: ``lora-conformance scoreboard REPORTS -o SITE``.
"""

from lora_conformance.scoreboard.board import suite_version_of

__all__ = ["suite_version_of"]
