"""Engine writers, one per transport, behind `EngineWriter`."""

from .base import EngineWriter
from .colocate import ColocateWriter, EnginePushError
from .server import ServerWriter

__all__ = ["ColocateWriter", "EnginePushError", "EngineWriter", "ServerWriter"]
