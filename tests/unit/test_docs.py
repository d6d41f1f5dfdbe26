"""The README and docs/ point at files that exist.

Why: the README links into docs/ and the pages link to each other and to the benchmark results; a page renamed or
split must not leave a link to nothing behind (the split of the README into docs/ left one).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_pages_exist() -> None:
    assert len(PAGES) > 1, "docs/ has no pages"


def test_every_relative_link_points_at_a_file() -> None:
    broken = []
    for page in PAGES:
        for match in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", page.read_text()):
            target = match.group(1)
            if target.startswith(("http://", "https://")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing: " + ", ".join(broken)
