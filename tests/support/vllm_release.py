"""Test environment only: run the trainer side against another vLLM release's own weight-transfer code.

Why: vLLM 0.33 rewrote the trainer-side `WeightSource` (docs/install.md), and no CPU build of vLLM newer than 0.32
exists, so the installed engine and server stay 0.32. The weight-transfer package (`vllm/distributed/weight_transfer/`)
is pure Python on the trainer side; `.ci/setup` extracts it from the released wheels (`pip download vllm==0.34.0
--no-deps`) into `.ci-cache/vllm-<version>/`, and `use_release` makes a trainer process import that package in place
of the installed one, unmodified. The server, a separate process, keeps the installed vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

__all__ = ["PACKAGE", "release_dir", "use_release"]

PACKAGE = "vllm.distributed.weight_transfer"
CACHE = Path(__file__).resolve().parents[2] / ".ci-cache"


def release_dir(version: str) -> Path:
    """Where `.ci/setup` put the weight-transfer package of vLLM `version` (a folder holding `vllm/distributed/`)."""
    return CACHE / f"vllm-{version}"


class _ReleaseFinder(importlib.abc.MetaPathFinder):
    """Finds `vllm.distributed.weight_transfer` in the release folder; its submodules then follow its `__path__`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != PACKAGE:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(self.root / "vllm" / "distributed")])


def use_release(root: str | Path) -> None:
    """From now on, this process imports `vllm.distributed.weight_transfer` from `root` (see the module docstring).

    Raises:
        RuntimeError: the installed package was imported already, or `root` does not hold one.
    """
    root = Path(root)
    if not (root / "vllm" / "distributed" / "weight_transfer" / "base.py").is_file():
        raise RuntimeError(f"{root} holds no vllm/distributed/weight_transfer/base.py; run .ci/setup")
    loaded = [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]
    if loaded:
        raise RuntimeError(f"{', '.join(loaded)} imported before use_release({root})")
    sys.meta_path.insert(0, _ReleaseFinder(root))
