"""Every measured figure in README.md and docs/ stays tied to the run it comes from.

A figure is a number with a unit of measurement (ms, us, x, MB, GB, GB/s, TB/s, %; s and min where the block names
its sources) in prose, a list or a table row.
Outside generated blocks (`<!-- NAME:begin ... -->` ... `<!-- NAME:end -->`, each checked against its generator by
its own test) and tables quoted verbatim from a results file (tests/unit/test_docs_figures.py), every such figure
must come from a results file the text names: `benchmarks/results/NAME.md` in the same paragraph, list item or row,
or an invisible `<!-- figures: NAME.md ... -->` line that names the sources of everything below it up to the next
heading. Each figure must be one of its sources' numbers, as written there or rounded to the digits shown (a GB
figure may be an MB cell over 1000), or a ratio (x) or a change (%) of two numbers written beside it in the same
block that are themselves its sources' numbers ("8% slower (179 -> 193 ms)"); and the section must say the machine and the date each source was measured on
(both read from the source's first lines). So a benchmark re-run that changes a number fails here until the prose
is rewritten, and a sentence cannot restate a figure from a run the page does not name.

Targets and settings (`within 2x`, `16 MiB`) are not measurements: targets are written in target tables' first
column (skipped) or in words; settings in MiB/GiB or in backticks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from benchmarks.doc_blocks import BLOCKS as GENERATED
from benchmarks.doc_blocks import shown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FIGURE = re.compile(
    r"(?<![\w.`/+-])(\d+(?:\.\d+)?)(?:\s?(?:-|to|/)\s?(\d+(?:\.\d+)?))?\s?(ms|us|x|MB|GB/s|GB|TB/s|%|s|min)(?![\w/])"
)
NUMBER = re.compile(r"\d+(?:\.\d+)?")
SOURCES = re.compile(r"<!-- figures: ([^>]*?) -->")
NAMED = re.compile(r"benchmarks/results/([\w.-]+\.md)")
_MONTHS = "January February March April May June July August September October November December".split()
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
_LONG = re.compile(rf"({'|'.join(_MONTHS)}) (\d{{1,2}}), (\d{{4}})")
_MACHINES = ("H100", "H200", "CPU")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str
    sources: tuple[str, ...]
    section: str


def _visible(text: str) -> str:
    return re.sub(r"<!--.*?-->", "", re.sub(r"`[^`]*`", "", text))


def _blocks(page: Path) -> list[Block]:
    """Paragraphs, list items and table rows outside code and generated blocks, with their sources."""
    lines = page.read_text().splitlines()
    quoted = {row for f in RESULTS.glob("*.md") for row in f.read_text().splitlines() if row.startswith("|")}
    blocks: list[Block] = []
    sections: list[tuple[int, int]] = []  # (first line, last line) of each heading's section
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("#"):
            sections.append((start, i))
            start = i
    sections.append((start, len(lines)))

    def section_of(i: int) -> str:
        a, b = next((a, b) for a, b in sections if a <= i < b)
        return "\n".join(lines[a:b])

    declared: tuple[str, ...] = ()
    in_code = generated = False
    target_table = False
    current: list[str] = []
    first = 0

    def flush() -> None:
        if current:
            text = "\n".join(current)
            named = tuple(NAMED.findall(text))
            blocks.append(Block(page.name, first + 1, text, declared + named, section_of(first)))
            current.clear()

    for i, line in enumerate(lines):
        if line.startswith("```"):
            flush()
            in_code = not in_code
            continue
        if in_code:
            continue
        if re.match(r"<!-- [\w-]+:begin", line):
            flush()
            generated = True
            continue
        if re.match(r"<!-- [\w-]+:end", line):
            generated = False
            continue
        if generated:
            continue
        if line.startswith("#"):
            flush()
            declared = ()
            continue
        match = SOURCES.match(line)
        if match:
            flush()
            declared = tuple(match.group(1).split())
            continue
        if line.startswith("|"):
            flush()
            if line.startswith("| target |"):
                target_table = True
            if line in quoted or set(line) <= set("|-: "):
                continue
            cells = line.strip("|").split("|")
            if target_table:
                cells = cells[1:]  # the target itself
            first = i
            current.append("|".join(cells))
            flush()
            continue
        target_table = False
        if not line.strip() or re.match(r"\s*(- |\d+\. )", line):
            flush()
            first = i
        if line.strip():
            if not current:
                first = i
            current.append(line)
    flush()
    return blocks


# Seconds and minutes are also what settings and test bounds are given in (`sync_timeout_s` 600 s, "within 10 s"):
# they are checked where a block names its sources, and do not by themselves make a block need one.
_TIME_ONLY = ("s", "min")


def _figures(text: str, *, times: bool = True) -> list[str]:
    found = []
    for a, b, unit in FIGURE.findall(_visible(text)):
        if unit in _TIME_ONLY and not times:
            continue
        found += [f"{a}{unit}"] + ([f"{b}{unit}"] if b else [])
    return found


def _rounds_to(value: Decimal, shown: str, *, exact_digits: bool) -> bool:
    digits = len(shown.partition(".")[2])
    if exact_digits and len(str(value).partition(".")[2]) < digits:
        return False  # a figure more precise than its source is not its source's
    quantum = Decimal(1).scaleb(-digits)
    return any(value.quantize(quantum, rounding=r) == Decimal(shown) for r in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def _matches(shown: str, unit: str, numbers: set[str], beside: list[str]) -> bool:
    """`shown` is one of `numbers` (rounded), or the ratio or change of two numbers `beside` it that are."""
    for n in numbers:
        candidates = [Decimal(n)] + ([Decimal(n) / 1000] if unit == "GB" else [])
        if any(_rounds_to(value, shown, exact_digits=True) for value in candidates):
            return True
    if unit not in ("x", "%"):
        return False
    checked = [Decimal(b) for b in beside if b in numbers and Decimal(b) > 0]
    for a in checked:
        for b in checked:
            ratio = a / b
            derived = [ratio] if unit == "x" else [abs(ratio - 1) * 100, ratio * 100]
            if any(_rounds_to(value, shown, exact_digits=False) for value in derived):
                return True
    return False


def _date_and_machine(source: str) -> tuple[list[str], str | None]:
    head = "\n".join((RESULTS / source).read_text().splitlines()[:3])
    dates = []
    for y, m, d in _ISO.findall(head):
        dates += [f"{y}-{m}-{d}", f"{_MONTHS[int(m) - 1]} {int(d)}, {y}"]
    for month, d, y in _LONG.findall(head):
        dates += [f"{month} {int(d)}, {y}", f"{y}-{_MONTHS.index(month) + 1:02d}-{int(d):02d}"]
    machine = next((m for m in _MACHINES if m in head), "CPU" if "x86_64" in head else None)
    return dates, machine


BLOCKS = [b for page in PAGES for b in _blocks(page) if _figures(b.text, times=False) or (b.sources and _figures(b.text))]


def test_the_check_sees_figures_on_several_pages() -> None:
    assert len({b.page for b in BLOCKS}) >= 5, sorted({b.page for b in BLOCKS})


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_a_figure_is_its_sources_number(block: Block) -> None:
    where = f"{block.page}:{block.line}"
    assert block.sources, (
        f"{where}: {_figures(block.text)} with no results file named (name benchmarks/results/NAME.md in the "
        f"text, or put `<!-- figures: NAME.md -->` above it); text: {block.text[:200]!r}"
    )
    missing = [s for s in block.sources if not (RESULTS / s).is_file()]
    assert not missing, f"{where}: names {missing}, which are not in benchmarks/results/"
    numbers = {n for s in block.sources for n in NUMBER.findall((RESULTS / s).read_text())}
    figures = _figures(block.text)
    # The numbers written in the block: what a ratio or a change may be made of (each checked above or below).
    beside = NUMBER.findall(_visible(block.text))
    wrong = [
        f for f in figures if not _matches(re.match(r"[\d.]+", f).group(), f.lstrip("0123456789."), numbers, beside)
    ]
    assert not wrong, (
        f"{where}: {wrong} are not numbers of {list(block.sources)} (re-run drifted? rewrite the sentence from the "
        f"results file); text: {block.text[:300]!r}"
    )
    section = _visible(block.section)
    for source in block.sources:
        dates, machine = _date_and_machine(source)
        assert dates and any(d in section for d in dates), (
            f"{where}: the section does not say when {source} was measured ({dates[:2] or 'the file says no date'})"
        )
        assert machine and machine in section, f"{where}: the section does not name {source}'s machine ({machine})"


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_a_generated_block_is_its_rendering(name: str) -> None:
    """The blocks `python -m benchmarks.doc_blocks` writes (tables derived from several results files)."""
    page, render = GENERATED[name]
    held = shown((ROOT / page).read_text(), name)
    assert held is not None, f"{page} lacks the markers of the {name} block"
    assert held == render(), f"{page}'s {name} block is stale: run `python -m benchmarks.doc_blocks`"
