"""Shared set-up: engine environment, tiny local checkpoints (built once per session), the job launcher."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The engine runs in-process with a small explicit KV cache (GiB, CPU backend); set before anything imports vLLM.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """`checkpoints(family)` -> path of a tiny local checkpoint of that family, built on first use."""
    from fsdp_sync._demo.models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(root / family, family)
        return built[family]

    return get


_TESTS_ROOT = Path(__file__).resolve().parent
# Each suite folder is a marker (registered in pyproject.toml), so a local run can pick the fast ones:
# `pytest tests -m unit` (about 1-3 minutes on 2 cores), `-m "not e2e"` (unit and distributed). CI runs everything.
_SUITES = ("unit", "dist", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its suite folder's name."""
    for item in items:
        suite = Path(str(item.path)).resolve().relative_to(_TESTS_ROOT).parts[0]
        if suite in _SUITES:
            item.add_marker(suite)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail a whole-suite run when a test folder collects nothing.

    Why: pytest's default `norecursedirs` silently skipped `tests/dist` for months (see pyproject.toml). When the run
    covers the whole `tests/` tree with no selection, every folder holding `test_*.py` files must contribute at least
    one collected test (skipped ones count); otherwise the run stops naming the folders.
    """
    config = session.config
    if config.option.keyword or config.option.markexpr:
        return
    args = [Path(a.split("::")[0]).resolve() for a in config.args]
    if _TESTS_ROOT not in args:
        return
    folders = {p.parent for p in _TESTS_ROOT.rglob("test_*.py")}
    collected = {Path(str(item.path)).resolve().parent for item in session.items}
    silent = sorted(str(f.relative_to(_TESTS_ROOT.parent)) for f in folders if f not in collected)
    if silent:
        raise pytest.UsageError(
            f"These test folders collected no test: {', '.join(silent)}. Check pytest's norecursedirs and the "
            "folders' names (pytest skips 'dist' and 'build' by default)."
        )
