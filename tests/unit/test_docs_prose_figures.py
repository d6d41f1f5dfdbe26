"""Every measured figure in README.md and docs/ stays tied to the run it comes from.

A figure is a number with a unit of measurement (ms, us, x, MB, GB, GB/s, TB/s, %; s and min where the block names
its sources) in prose, a list or a table row.
Outside generated blocks (`<!-- NAME:begin ... -->` ... `<!-- NAME:end -->`, each checked against its generator by
its own test) and tables quoted verbatim from a results file (tests/unit/test_docs_figures.py), every such figure
must come from a results file the text names: `benchmarks/results/NAME.md` in the same paragraph, list item or row,
or an invisible `<!-- figures: NAME.md ... -->` line that names the sources of everything below it up to the next
heading. Each figure must be a number of a row the block describes, as written there or rounded to the digits shown
(a GB figure may be an MB cell over 1000), or a ratio (x) or a change (%) of two numbers written beside it in the
same block that are themselves numbers of rows it describes ("8% slower (179 -> 193 ms)"); and the section must say
the machine and the date each source was measured on (both read from the source's first lines). So a benchmark
re-run that changes a number fails here until the prose is rewritten, and a sentence cannot restate a figure from a
run the page does not name.

A row is a data row of one of the source's tables (never its header lines, which hold dates, machines, commits and
rank counts, nor a table's column names), and its numbers are those of its value cells (a number with at most a
unit; `r=16` or `qwen2-36m` name the row, they are not its figures). A block describes a row when it names one of
the words that set the row apart in its table (`fsdp1`, `ours-flat`, `7b`, `1e-05`; words every row of the table
shares do not count): a figure from the FSDP2 row of a sentence about FSDP1 only, or a digit of a date, fails.

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
    # What names the rows the figures come from: the text, and in a target table the target it is measured against.
    context: str = ""


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
    target = ""

    def flush() -> None:
        nonlocal target
        if current:
            text = "\n".join(current)
            named = tuple(NAMED.findall(text))
            blocks.append(Block(page.name, first + 1, text, declared + named, section_of(first), f"{target} {text}"))
            current.clear()
        target = ""

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
                target, cells = cells[0], cells[1:]  # the target itself: not a figure, but it names the rows
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


@dataclass(frozen=True)
class Row:
    """A data row of a results file's table: the numbers of its value cells, and the words that set it apart."""

    source: str
    numbers: frozenset[str]
    words: frozenset[str]


_UNITS = re.compile(r"\b(?:ms|us|s|min|MB|GB|GB/s|TB/s|MiB|GiB)\b|[x%]")


def _normal(text: str) -> str:
    """Lower case, exponents without leading zeros (`1e-05` and `1e-5` are one word)."""
    return re.sub(r"(\d)e([-+])0*(\d)", r"\1e\2\3", text.lower())


def _words(cell: str) -> set[str]:
    """The words of a cell: tokens with a letter (`qwen2-36m` -> qwen2, 36m; `ours-flat` -> ours, flat, ours-flat;
    `1e-05` -> 1e-5)."""
    text = _normal(cell)
    tokens = set(re.findall(r"\d+(?:\.\d+)?e[-+]\d+|[a-z0-9_]+(?:-[a-z][a-z0-9_]*)*", text))
    tokens |= {part for t in tokens for part in t.split("-")}
    return {t for t in tokens if re.search("[a-z]", t) and len(t) > 1}


def _rows(source: str) -> list[Row]:
    """Every data row of `source`'s tables (a table's first row, its column names, skipped)."""
    lines = (RESULTS / source).read_text().splitlines()
    tables: list[list[list[str]]] = []
    previous_is_row = False
    for i, line in enumerate(lines):
        is_row = line.startswith("|")
        if is_row and not set(line) <= set("|-: "):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            is_header = following.startswith("|") and set(following) <= set("|-: ")
            if not previous_is_row or is_header:
                tables.append([])
            if not is_header:
                tables[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        previous_is_row = is_row
    rows = []
    for table in tables:
        keyed = []
        for cells in table:
            values = [c for c in cells if not re.search("[A-Za-z]", _UNITS.sub("", c))]
            keys = [c for c in cells if c not in values]
            keyed.append(({n for c in values for n in NUMBER.findall(c)}, set().union(*map(_words, keys))))
        shared = set.intersection(*(words for _, words in keyed)) if len(keyed) > 1 else set()
        rows += [Row(source, frozenset(n), frozenset(w - shared or w)) for n, w in keyed]
    return rows


def _described(text: str, row: Row) -> bool:
    """The block names one of the words that set the row apart (as a word's start: `extract` in "extraction"; in
    code spans too, where rows are often named, but not in the names of results files)."""
    said = _normal(NAMED.sub("", re.sub(r"<!--.*?-->", "", text)))
    return any(re.search(rf"(?<![a-z0-9]){re.escape(w)}", said) for w in row.words)


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
    # The numbers of the rows this block describes, not of the whole file (dates, commits, other rows).
    numbers = {n for s in block.sources for row in _rows(s) if _described(block.context, row) for n in row.numbers}
    figures = _figures(block.text)
    # The numbers written in the block: what a ratio or a change may be made of (each checked above or below).
    beside = NUMBER.findall(_visible(block.text))
    wrong = [
        f for f in figures if not _matches(re.match(r"[\d.]+", f).group(), f.lstrip("0123456789."), numbers, beside)
    ]
    assert not wrong, (
        f"{where}: {wrong} are not numbers of the rows of {list(block.sources)} this text names (re-run drifted? a "
        f"figure of another row? rewrite the sentence from the results file); text: {block.text[:300]!r}"
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
