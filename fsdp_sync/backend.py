"""Which parallel wrapper a model is under, read from the model itself, once.

Why from the model and not from config flags: accelerate on CPU silently falls back to DDP under an FSDP config, and
TRL then still believes it runs FSDP1 (measured: its sync pushed nothing). The module tree is the only truth.
"""

from __future__ import annotations

import enum
import sys

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .errors import SyncError

__all__ = ["Backend", "UnsupportedBackendError", "detect_backend", "unwrap_outer", "user_model"]


class Backend(enum.Enum):
    FSDP1 = "fsdp1"
    FSDP2 = "fsdp2"
    DDP = "ddp"
    PLAIN = "plain"
    DEEPSPEED = "deepspeed"  # recognised, not gathered here: left to the trainer's own sync


class UnsupportedBackendError(SyncError):
    """The model is wrapped in a way this library does not gather from. A `SyncError` (and so a `RuntimeError`):
    raised at the first sync, before anything is gathered, it reaches the caller as itself on every rank that found
    it."""


def _is_compiled(model: nn.Module) -> bool:
    # NOTE: imported only if torch.compile was used in this process (importing torch._dynamo costs about a second).
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def unwrap_outer(model: nn.Module) -> nn.Module:
    """Remove wrappers that only enclose the whole model: DDP/DataParallel (`.module`) and torch.compile, unless the
    compiled module is itself an FSDP2 unit (accelerate may `fully_shard` the compiled model)."""
    while True:
        if isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        elif _is_compiled(model) and not isinstance(model, FSDPModule):
            model = model._orig_mod
        else:
            return model


def user_model(model: nn.Module) -> nn.Module:
    """The model the user built (a transformers or PEFT model), inside every whole-model wrapper (DDP, compile, the
    FSDP1 root). Used for its structure (config, conversions, adapters), never to gather."""
    while True:
        if isinstance(model, DistributedDataParallel | DataParallel | FSDP):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def detect_backend(model: nn.Module) -> Backend:
    """Classify `model` (as the trainer holds it) by the wrappers found in its module tree.

    DeepSpeed engines are recognised by class name (no import of deepspeed) and returned as `Backend.DEEPSPEED`: ZeRO
    gathers are the trainer's own sync's business.

    Raises:
        UnsupportedBackendError: FSDP1 and FSDP2 mixed in one tree, or DTensor parameters without any FSDP2 unit
            (tensor parallelism and other DTensor layouts).
    """
    if type(model).__name__ == "DeepSpeedEngine":
        return Backend.DEEPSPEED
    is_ddp = isinstance(model, DistributedDataParallel | DataParallel)
    inner = unwrap_outer(model)
    modules = list(inner.modules())
    has_fsdp1 = any(isinstance(m, FSDP) for m in modules)
    has_fsdp2 = any(isinstance(m, FSDPModule) for m in modules)
    match (has_fsdp1, has_fsdp2):
        case (True, True):
            raise UnsupportedBackendError(
                f"{type(inner).__name__} mixes FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard) units; "
                "wrap the model with one of them."
            )
        case (True, False):
            return Backend.FSDP1
        case (False, True):
            return Backend.FSDP2
    dtensors = [n for n, p in inner.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise UnsupportedBackendError(
            f"{len(dtensors)} parameter(s) are DTensors but no module is an FSDP2 unit (e.g. tensor parallelism), "
            f"which this library does not gather: {', '.join(dtensors[:5])}{' ...' if len(dtensors) > 5 else ''}"
        )
    return Backend.DDP if is_ddp else Backend.PLAIN
