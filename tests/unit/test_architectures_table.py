"""The support table of docs/architectures.md is the rendering of what the architecture sweep recorded
(`benchmarks/results/architectures.json`, which `tests/e2e/test_architectures.py` compares with what it finds on every
run), so the page cannot drift from what ran."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.architectures import BEGIN, END, RESULTS, table
from fsdp_sync._demo.models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_rendered_sweep() -> None:
    page = (ROOT / "docs" / "architectures.md").read_text()
    assert BEGIN in page and END in page, "docs/architectures.md lacks the table's markers"
    shown = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == table(), "docs/architectures.md's table is stale: paste `python -m benchmarks.architectures`"


def test_every_family_the_tests_build_is_in_the_record() -> None:
    recorded = json.loads(RESULTS.read_text())
    assert recorded.keys() == FAMILIES.keys()
    assert {row["colocate"] for row in recorded.values()} <= {"proven", "refused", "engine-limited"}
