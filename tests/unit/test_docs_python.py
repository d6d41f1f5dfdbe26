"""Every Python block of the README and docs/ runs as pasted, unless a marker right above it says why it cannot here
(`<!-- docs-test: skip: ... -->`), or names what the block assumes from its surroundings and the test provides
(`<!-- docs-test: context: trainer ... -->`: a trainer whose `model_wrapped` is a tiny model, one process)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- docs-test: (skip|context): ([^>]*?) -->\s*$")
CONTEXTS = {
    "trainer": (
        "import types, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from fsdp_sync._demo.models import TinySpec, config_for\n"
        "trainer = types.SimpleNamespace(model_wrapped=AutoModelForCausalLM.from_config(config_for(TinySpec()), "
        "dtype=torch.float32))\n"
    )
}


def python_blocks() -> list[tuple[str, str, str | None, str | None]]:
    """(page:line, code, marker kind, marker text) for every ```python block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                i += 1
                body = []
                while lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                marker = MARKER.search(lines[start - 1]) if start else None
                kind, text = (marker.group(1), marker.group(2)) if marker else (None, None)
                found.append((f"{page.relative_to(ROOT)}:{start + 1}", "\n".join(body) + "\n", kind, text))
            i += 1
    return found


BLOCKS = python_blocks()


def test_the_docs_have_python_blocks_and_every_marker_is_understood() -> None:
    assert len(BLOCKS) >= 4
    for where, _, kind, text in BLOCKS:
        if kind == "context":
            assert text.split()[0] in CONTEXTS, f"{where}: unknown context {text!r}"
        if kind == "skip":
            assert len(text) > 20, f"{where}: a skip says why"


@pytest.mark.parametrize(("where", "code", "kind", "text"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_runs_as_pasted(where: str, code: str, kind: str | None, text: str | None) -> None:
    if kind == "skip":
        pytest.skip(f"{where}: {text}")
    prelude = CONTEXTS[text.split()[0]] if kind == "context" else ""
    proc = subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, f"{where} does not run as pasted:\n{proc.stderr[-3000:]}"
