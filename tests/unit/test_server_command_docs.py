"""Every vLLM server command the pages print is `fsdp_sync.server_command`'s output for the config the page states
(issue 49): its environment and arguments as `tests/e2e/documented.py` reads them (what the end-to-end tests start),
and its text as the command prints it. A server command on a page that no config here accounts for fails too.

Why: the pages' commands are what users paste and what the shared test servers run (tests/e2e/conftest.py); when
they are the generator's output, a rule of the generator (a flag TRL needs, a LoRA limit) reaches every page, and a
page cannot drift from it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_sync.server_command import CPU_SERVER_MODULE, server_command
from tests.e2e.documented import documented_command

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
WIDTH = 120

# What each page states: the CPU commands run the venv's interpreter on the model directory `DIR`, on 127.0.0.1:8000.
CPU = {"model": "DIR", "device": "cpu", "host": "127.0.0.1", "python": ".venv/bin/python"}
TWO_CORES = {"cpus": [0, 1]}  # "On a 2-core machine"
LORA = {**CPU, "dtype": "float32", "adapter": True, "lora_rank": 16}  # adapters.md's example: LoraConfig(r=16)

# (page, strings that pick the command on the page, the config the page states for it)
CPU_COMMANDS = [
    ("docs/server.md", (), CPU),
    ("docs/server.md", ("--tensor-parallel-size 2",), {**CPU, **TWO_CORES, "tensor_parallel_size": 2}),
    ("docs/server.md", ("--data-parallel-size 2",), {**CPU, **TWO_CORES, "data_parallel_size": 2}),
    ("docs/adapters.md", ("--enable-lora",), {**LORA, "kept_versions": 2}),
    ("docs/adapters.md", ("--tensor-parallel-size 2",), {**LORA, **TWO_CORES, "kept_versions": 2,
                                                          "tensor_parallel_size": 2}),
    ("docs/adapters.md", ("--data-parallel-size 2",), {**LORA, **TWO_CORES, "kept_versions": 2,
                                                        "data_parallel_size": 2}),
    ("docs/async.md", (), CPU),
    # TRL 1.16's default max_staleness (4): 5 versions kept
    ("docs/async.md", ("--enable-lora",), {**LORA, "kept_versions": 5}),
]  # fmt: skip
GPU_COMMANDS = [
    ("docs/server.md", {"model": "Qwen/Qwen2.5-7B", "device": "cuda", "cuda_devices": "0"}),
    ("docs/async.md", {"model": "MODEL_DIR", "device": "cuda"}),
]


def _expected(config: dict) -> str:
    config = dict(config)
    return server_command(config.pop("model"), **config).shell(width=WIDTH)


def _server_commands(page: str) -> list[str]:
    """The text of every server command in the page's code blocks (a command with its continuation lines)."""
    commands: list[str] = []
    fenced = False
    current: list[str] = []
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            current = []
            continue
        if not fenced:
            continue
        current.append(line)
        if not line.rstrip().endswith("\\"):
            text = "\n".join(current)
            if CPU_SERVER_MODULE in text or re.search(r"(^|\s)vllm serve ", text):
                commands.append(text)
            current = []
    return commands


@pytest.mark.parametrize(
    ("page", "containing", "config"), CPU_COMMANDS, ids=[f"{p}{list(c)}" for p, c, _ in CPU_COMMANDS]
)
def test_a_documented_cpu_command_is_the_generators(page: str, containing: tuple[str, ...], config: dict) -> None:
    config = dict(config)
    expected = server_command(config.pop("model"), **config)
    env, argv = documented_command(page.removeprefix("docs/"), *containing)
    assert (env, argv) == (expected.env, expected.argv)


@pytest.mark.parametrize(("page", "config"), GPU_COMMANDS, ids=[p for p, _ in GPU_COMMANDS])
def test_a_documented_gpu_command_is_the_generators(page: str, config: dict) -> None:
    assert _expected(config) in _server_commands(page)


@pytest.mark.parametrize("page", PAGES)
def test_every_server_command_on_a_page_is_the_generators_text(page: str) -> None:
    """As printed (`python -m fsdp_sync.server_command ...`), for one of the configs above."""
    configs = [c for p, _, c in CPU_COMMANDS if p == page] + [c for p, c in GPU_COMMANDS if p == page]
    expected = {_expected(c) for c in configs}
    found = _server_commands(page)
    assert [c for c in found if c not in expected] == []
    assert expected <= set(found)


def test_the_pages_have_server_commands() -> None:
    """The checks above have something to check (a renamed module would otherwise pass them silently)."""
    assert sum(len(_server_commands(p)) for p in PAGES) == len(CPU_COMMANDS) + len(GPU_COMMANDS)


def test_the_async_pages_server_is_server_mds() -> None:
    """docs/async.md's first CPU command is docs/server.md's, word for word (tests/e2e/test_documented_server.py
    runs that one)."""
    assert documented_command("async.md") == documented_command("server.md")
