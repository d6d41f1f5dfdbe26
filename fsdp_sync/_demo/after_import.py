"""Test environment only: run a callback on a module right after it is imported, in processes that start with this
package's `sitecustomize` (`fsdp_sync._demo.no_torchvision.SITE_DIR`).

Why not at interpreter start: `sitecustomize` runs in every Python process started with that folder on its
PYTHONPATH, including the short helpers vLLM and torch spawn (Inductor's ISA probes, vLLM's model inspection).
Importing transformers or vLLM there to patch them cost each helper 6-7 CPU s; measured, a server's first request for
logprobs took 28 s, of which the three probes' imports were three quarters. A callback runs only where the module is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


def after_import(callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
    """Run each callback on its module (by name) right after the module is executed, before any other module can
    import names from it; at once for a module already imported."""
    pending = dict(callbacks)
    for name in list(pending):
        if name in sys.modules:
            pending.pop(name)(sys.modules[name])
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.callbacks = callbacks

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        callback = self.callbacks.pop(name, None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                original = spec.loader.exec_module

                def exec_module(module: ModuleType) -> None:
                    original(module)
                    callback(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None
