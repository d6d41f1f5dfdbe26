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
    from fsdp_sync.testing.models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(root / family, family)
        return built[family]

    return get
