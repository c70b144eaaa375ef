"""The cases earlier reports finished, as pytest ``--deselect`` arguments: a cold certification
that needs more than one device call goes on where the last one stopped, instead of running the
finished cases again (their references are cached, but their engine work is not).

    python bench/finished_cases.py RUN1/report.json RUN2/report.json ...   # prints --deselect ID lines

A case counts as finished where it has a result: a call phase (passed, failed, skipped, or the
failed call pytest-xdist reports for a crashed worker), or a setup that failed or skipped. A case
its run stopped before it finished runs again: the rule ``lora-conformance report merge`` applies
when it joins the runs (``report.merge.unfinished``). A report that is missing or unreadable is
named on stderr and contributes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def finished(report: dict) -> list[str]:
    from lora_conformance.report.merge import unfinished

    return [record["nodeid"] for record in report.get("records", []) if not unfinished(record)]


def main(argv: list[str]) -> int:
    seen: dict[str, None] = {}
    for name in argv:
        try:
            doc = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            print(f"finished_cases.py: {name}: not read ({exc})", file=sys.stderr)
            continue
        for nodeid in finished(doc):
            seen.setdefault(nodeid)
    for nodeid in seen:
        print("--deselect")
        print(nodeid)
    print(f"finished_cases.py: {len(seen)} finished cases in {len(argv)} report(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
