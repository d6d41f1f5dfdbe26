"""Engine writers, one per transport, behind `EngineWriter`.

`ServerWriter` loads lazily: it imports vLLM's weight-transfer API, which colocated and dry runs do not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import EngineWriter
from .colocate import ColocateWriter, EnginePushError

if TYPE_CHECKING:
    from .server import ServerPushError, ServerTransportError, ServerWriter

__all__ = ["ColocateWriter", "EnginePushError", "EngineWriter", "ServerPushError", "ServerTransportError", "ServerWriter"]

_SERVER_NAMES = ("ServerPushError", "ServerTransportError", "ServerWriter")


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module 'fsdp_sync.writers' has no attribute {name!r}")
