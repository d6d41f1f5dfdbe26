"""Blocks of the docs rendered from results files: `python -m benchmarks.doc_blocks` rewrites each between its
markers, and tests/unit/test_docs_prose_figures.py checks that every block is its rendering.

Why generated: a table that compares rows of several results files (or derives a figure from them) cannot be
checked row by row against one file; rendering it from the files makes a re-run change it, or fail the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .report import summarize

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
_MONTHS = "January February March April May June July August September October November December".split()


def _when(measured: str) -> str:
    year, month, day = (int(x) for x in measured.split("-"))
    return f"{_MONTHS[month - 1]} {day}, {year}"


def _machine(machine: str) -> str:
    """A short name of the machine a results file was measured on."""
    for card in ("H100", "H200"):
        if card in machine:
            return f"one {card}"
    return "CPU, 2 gloo ranks" if "CPU" in machine else machine


def rounds_cost() -> str:
    """The status rounds' cost: the default sync (`ours-flat`) against the same sync without its rounds
    (`ours-flat-norounds`), for every model and backend the colocated CPU and GPU runs measured both in."""
    lines = [
        "| run | model | backend | ours-flat (rounds) ms | ours-flat-norounds ms | cost | medians of |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    ranges = []
    for kind in ("cpu", "gpu"):
        data = json.loads((RESULTS / f"{kind}.json").read_text())
        costs = []
        by_key = {(s["model"], s["backend"], s["method"]): s for s in summarize(data["rows"])}
        run = f"`{kind}.md`, {_machine(data['machine'])}, {_when(data['measured'])}"
        for (model, backend, method), rounds in sorted(by_key.items()):
            bare = by_key.get((model, backend, "ours-flat-norounds"))
            if method != "ours-flat" or bare is None:
                continue
            cost = rounds["seconds"] / bare["seconds"] - 1
            costs.append(cost)
            lines.append(
                f"| {run} | {model} | {backend} | {rounds['seconds'] * 1e3:.1f} | {bare['seconds'] * 1e3:.1f} | "
                f"{cost:+.0%} | {rounds['reps']} |"
            )
        if costs:
            ranges.append(f"{_machine(data['machine'])} ({kind}.md): {min(costs):+.0%} to {max(costs):+.0%}")
    # NOTE: a cost below zero is the run's noise (the rounds add work, never remove it).
    return "\n".join(lines) + "\n\nThe cost, per run: " + "; ".join(ranges) + "."


# Block name -> (page, renderer).
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {"rounds-cost": ("docs/failures.md", rounds_cost)}


def markers(name: str) -> tuple[re.Pattern[str], str]:
    """The begin marker (any comment after the name) and the end marker of a block."""
    return re.compile(rf"<!-- {name}:begin[^>]*-->\n"), f"<!-- {name}:end -->"


def shown(page_text: str, name: str) -> str | None:
    """What the page holds between the block's markers (None without them)."""
    begin, end = markers(name)
    match = begin.search(page_text)
    if match is None or end not in page_text[match.end() :]:
        return None
    return page_text[match.end() :].split(end, 1)[0].strip()


def main() -> None:
    for name, (page, render) in BLOCKS.items():
        path = ROOT / page
        text = path.read_text()
        begin, end = markers(name)
        match = begin.search(text)
        if match is None:
            raise SystemExit(f"{page} has no `<!-- {name}:begin ... -->` marker")
        tail = text[match.end() :].split(end, 1)[1]
        path.write_text(text[: match.end()] + render() + "\n" + end + tail)
        print(f"{page}: {name} rewritten")


if __name__ == "__main__":
    main()
