"""fsdp-vllm-sync: correct, memory-bounded weight sync from FSDP1/FSDP2/DDP trainers into vLLM."""

from .backend import Backend, UnsupportedBackendError, detect_backend
from .config import SyncConfig
from .gather import make_gatherer
from .mixin import FSDPVLLMSyncMixin
from .peft_merge import PeftMerge, UnsupportedAdapterError
from .pipeline import IncompleteSyncError, SyncPlan, WeightSync
from .report import SyncReport
from .writers import ColocateWriter, EnginePushError, EngineWriter, ServerWriter

__all__ = [
    "Backend",
    "ColocateWriter",
    "EnginePushError",
    "EngineWriter",
    "FSDPVLLMSyncMixin",
    "IncompleteSyncError",
    "PeftMerge",
    "ServerWriter",
    "SyncConfig",
    "SyncPlan",
    "SyncReport",
    "UnsupportedAdapterError",
    "UnsupportedBackendError",
    "WeightSync",
    "detect_backend",
    "make_gatherer",
]
