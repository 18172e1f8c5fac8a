"""The documentation a newcomer reads names only what is in the repository (issue #37,
item 10): no `../shared/...` and no absolute paths of one machine (/work/...)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A lab journal records each command as it was run (with the paths of that machine).
# docs/performance.md is edited with the benchmark work and still names the shared trace as
# ../shared/traces/synthetic_trace.jsonl: to be reworded there (issue #37, item 10), then
# dropped from this set.
SKIPPED = {"docs/performance-history.md", "docs/performance.md"}
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/|/home/\w+/|/root/")


def test_docs_name_no_path_outside_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in pages if str(p.relative_to(ROOT)) not in SKIPPED
             for n, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)
