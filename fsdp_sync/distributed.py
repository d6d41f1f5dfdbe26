"""The few collectives the pipeline itself runs (the gatherers run FSDP's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "agree_on_failures", "all_ranks_ok", "rank", "stop_together"]


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


@dataclass(frozen=True)
class RankFailure:
    """What failed on one rank: the stage (`"push"`, `"gather"`, ...) and the error, as text."""

    rank: int
    stage: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} ({self.stage}): {self.error}"


def agree_on_failures(failure: RankFailure | None) -> list[RankFailure]:
    """Every rank's failure, on every rank (empty when none failed).

    One int all-reduce when all went well; only after a failure do the ranks exchange their messages, so that each
    rank can name the failing ones. Every rank must call it at the same point of the sync.
    """
    if not all_ranks_ok(failure is None):
        if not (dist.is_available() and dist.is_initialized()):
            return [failure] if failure is not None else []
        gathered: list[RankFailure | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, failure)
        return [f for f in gathered if f is not None]
    return []


def stop_together(error: Exception | None, stage: str, remote: type[Exception], consequence: str) -> None:
    """Agree with every rank on this rank's `error` (None: none); then raise it here, or `remote` on the ranks that did
    not fail, naming every failing rank, its stage and its error, followed by `consequence`.

    Every rank must call it at the same point; it returns only when no rank failed.
    """
    failure = RankFailure(rank(), stage, f"{type(error).__name__}: {error}") if error is not None else None
    failures = agree_on_failures(failure)
    if error is not None:
        raise error
    if failures:
        raise remote(f"The weight sync failed on {'; '.join(f.describe() for f in failures)}. {consequence}")
