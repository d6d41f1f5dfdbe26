"""The few collectives the pipeline itself runs (the gatherers run FSDP's)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_ranks_ok", "rank"]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_ranks_ok(ok: bool) -> bool:
    """True only if `ok` on every rank; a single process answers `ok`.

    Why: a check that fails on one rank must stop every rank before the gather, or the others block in a collective.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
