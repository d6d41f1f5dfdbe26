"""The docs quote measured figures from `benchmarks/results/`: a table that follows a paragraph naming a results file
must be that file's table (every row of it found there, verbatim), and that file must say when it was measured, so
that a table in the docs cannot drift from the run it claims to come from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# A results file named in the few lines before a table is that table's source.
_SOURCE = re.compile(r"benchmarks/results/([\w.-]+\.md)")
_LOOKBACK = 6
_DATE = re.compile(r"Measured (\d{4}-\d{2}-\d{2})|measured (?:on )?\w+ \d{1,2}, \d{4}", re.IGNORECASE)


def _quoted_tables() -> list[tuple[str, int, str, list[str]]]:
    """(doc, line of the table, results file, the table's rows) for every table that names its results file."""
    found = []
    for doc in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("|"):
                i += 1
                continue
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            # NOTE: the paragraph right before the table: a heading, an image or another table ends it.
            above = []
            for line in reversed(lines[max(0, start - _LOOKBACK) : start]):
                if line.startswith(("#", "|", "![")):
                    break
                if re.match(r"<!-- [\w-]+:begin", line):
                    above = []  # a generated block: its own test checks it against its generator
                    break
                above.append(line)
            before = "\n".join(reversed(above))
            names = _SOURCE.findall(before)
            if names:
                found.append((doc.name, start + 1, names[-1], lines[start:i]))
    return found


TABLES = _quoted_tables()


def test_the_docs_quote_some_results() -> None:
    """The check below has something to check (a renamed results folder would otherwise pass it silently)."""
    assert {name for _, _, name, _ in TABLES} >= {"delta-cpu.md", "delta-gpu.md", "sparse-sync-cpu.md"}, TABLES


@pytest.mark.parametrize("doc, line, name, rows", TABLES, ids=[f"{d}:{n}" for d, n, _, _ in TABLES])
def test_a_quoted_table_is_its_results_file(doc: str, line: int, name: str, rows: list[str]) -> None:
    source = RESULTS / name
    assert source.exists(), f"{doc}:{line} quotes {source}, which does not exist"
    text = source.read_text()
    own = set(text.splitlines())
    missing = [row for row in rows if row not in own]
    assert not missing, (
        f"{doc}:{line}: {len(missing)} row(s) of this table are not in {name} (re-run its benchmark and paste its "
        f"table): {missing[:3]}"
    )
    assert _DATE.search(text), f"{name} does not say when it was measured (its first line should)"
