"""fsdp-vllm-sync: correct, memory-bounded weight sync from FSDP1/FSDP2/DDP trainers into vLLM.

The public names load lazily (PEP 562): the weight-transfer engine that runs inside a vLLM server process
(`fsdp_sync.transfer`) and the pure `fsdp_sync.compat` tables import this package without pulling in the gatherers,
the mixin or FSDP. `ServerPushError` and `ServerTransportError` load the server writer, and with it vLLM's
weight-transfer API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "AdapterFigures": "report",
    "Backend": "backend",
    "ColocateWriter": "writers",
    "DeltaFigures": "report",
    "EnginePushError": "writers",
    "EngineState": "errors",
    "EngineWriter": "writers",
    "FSDPVLLMSyncMixin": "mixin",
    "IncompleteSyncError": "sync.stream",
    "ManifestError": "errors",
    "NonFiniteWeightsError": "errors",
    "PeftMerge": "peft_merge",
    "RemoteSyncError": "errors",
    "ServerConfigError": "server_client",
    "ServerNoAnswerError": "server_client",
    "ServerPushError": "writers.server",
    "ServerResumeError": "writers.server",
    "ServerRouteMissing": "server_client",
    "ServerTransportError": "writers.server",
    "ServerUnavailableError": "server_client",
    "ServerWriter": "writers",
    "SparseFigures": "report",
    "SyncConfig": "config",
    "SyncError": "errors",
    "SyncPlan": "sync.stream",
    "SyncReport": "report",
    "SyncStageError": "errors",
    "SyncTimeoutError": "errors",
    "UnsupportedAdapterError": "peft_merge",
    "UnsupportedBackendError": "backend",
    "UnsupportedSetupError": "errors",
    "VerifyError": "errors",
    "WeightSync": "sync.pipeline",
    "detect_backend": "backend",
    "full_module": "full_weights",
    "iter_full_weights": "full_weights",
    "make_gatherer": "gather",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .backend import Backend, UnsupportedBackendError, detect_backend
    from .config import SyncConfig
    from .errors import (
        EngineState,
        ManifestError,
        NonFiniteWeightsError,
        RemoteSyncError,
        SyncError,
        SyncStageError,
        SyncTimeoutError,
        UnsupportedSetupError,
        VerifyError,
    )
    from .full_weights import full_module, iter_full_weights
    from .gather import make_gatherer
    from .mixin import FSDPVLLMSyncMixin
    from .peft_merge import PeftMerge, UnsupportedAdapterError
    from .sync.pipeline import WeightSync
    from .sync.stream import IncompleteSyncError, SyncPlan
    from .report import AdapterFigures, DeltaFigures, SparseFigures, SyncReport
    from .server_client import ServerConfigError, ServerNoAnswerError, ServerRouteMissing, ServerUnavailableError
    from .writers import ColocateWriter, EnginePushError, EngineWriter, ServerWriter
    from .writers.server import ServerPushError, ServerResumeError, ServerTransportError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
