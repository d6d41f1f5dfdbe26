"""The sync's own agreement between ranks, bounded in time, on a process group of its own.

Why a group of its own: the agreement is the one wait the sync adds between ranks, and it must be bounded by the
sync's timeout, not by the training group's (NCCL's default is 10-30 minutes, and a collective that timed out leaves
its group unusable). A gloo group created for the purpose carries `SyncConfig.sync_timeout_s`; a timeout there
breaks only that group, and `monitored_barrier` (gloo) names the ranks that did not arrive. The training group is
never used for agreement, so on GPUs the agreement costs no device synchronisation either.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import RankFailure, SyncError, SyncTimeoutError

__all__ = ["Coordinator", "distributed", "rank", "world_size"]

logger = logging.getLogger(__name__)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


# One control group per (training world, timeout): creating a group is itself a collective, so every WeightSync
# built at the same point on every rank gets the same group, and repeated builds (`iter_full_weights`) create none.
_GROUPS: dict[tuple[int, float], dist.ProcessGroup] = {}


def _control_group(timeout_s: float) -> dist.ProcessGroup:
    key = (id(dist.group.WORLD), timeout_s)
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if not _GROUPS:
            atexit.register(_destroy_control_groups)
        _GROUPS[key] = group
    return group


def _destroy_control_groups() -> None:
    """At exit, while the interpreter is still whole: destroy the groups this module made, unless the program already
    destroyed them. NOTE: a gloo group left to interpreter finalisation can abort the process (its worker threads
    release Python-owned tensors after the interpreter is gone: pytorch/pytorch#179291); training scripts often
    end without `destroy_process_group`, and this module's group should not add that risk."""
    for group in list(_GROUPS.values()):
        try:
            if distributed():
                dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - at exit (destroyed already, or no world left): report, never raise
            logger.debug("fsdp-vllm-sync: could not destroy the sync's control group at exit: %s", e)
    _GROUPS.clear()


@dataclass(frozen=True)
class _Unsendable:
    """Sent in place of an item that could not be pickled."""

    reason: str


class Coordinator:
    """Agrees with every rank on whether a stage of the sync failed, within `timeout_s`.

    Must be created at the same point on every rank (it creates a process group) and used at the same points.

    Args:
        timeout_s: the bound on each agreement: how long a rank waits for the others to arrive.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.group = _control_group(timeout_s) if world_size() > 1 else None
        self._broken: str | None = None

    def exchange(self, item: object) -> list[object]:
        """Every rank's `item`, on every rank, in rank order (bounded like `agree`; a small object per rank).

        Raises:
            SyncError: on every rank, when a rank's item cannot be pickled (that rank still takes part, so no rank
                waits for one that left).
            SyncTimeoutError: as `agree`.
        """
        if self.group is None:
            return [item]
        self._check_usable()
        try:
            pickle.dumps(item)
        except Exception as e:  # noqa: BLE001 - any pickling error: the other ranks must still get an answer
            item = _Unsendable(f"{type(item).__name__} cannot be pickled ({type(e).__name__}: {e})")
        try:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
            gathered: list[object] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, item, group=self.group)
        except RuntimeError as e:
            raise self._timed_out(e, None) from e
        unsendable = [f"rank {r}: {g.reason}" for r, g in enumerate(gathered) if isinstance(g, _Unsendable)]
        if unsendable:
            raise SyncError(
                f"The ranks could not exchange what this weight sync agrees on ({'; '.join(unsendable)}). This is a "
                "bug in fsdp-vllm-sync or in an object it was given; please report it with this message."
            )
        return gathered

    def broadcast(self, item: object) -> object:
        """Rank 0's `item`, on every rank (bounded like `agree`)."""
        return self.exchange(item)[0]

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise SyncTimeoutError(
                f"A previous weight sync timed out ({self._broken}); the ranks can no longer agree. Restart the job."
            )

    def _timed_out(self, e: RuntimeError, failure: RankFailure | None) -> SyncTimeoutError:
        self._broken = f"{type(e).__name__}: {e}"
        own = f" This rank had failed itself: {failure.describe()}." if failure is not None else ""
        return SyncTimeoutError(
            f"Not every rank reached the end of this weight sync stage within {self.timeout_s:g} s "
            f"(SyncConfig.sync_timeout_s) on rank {rank()}: {str(e).rstrip('.! ')}.{own} A rank that does not arrive "
            "is hung (look for a rank still inside its engine push or a collective) or has died; the ranks cannot "
            "run collectives together any more. Restart the job.",
            failures=(failure,) if failure is not None else (),
        )

    def agree(self, failure: RankFailure | None) -> list[RankFailure]:
        """Every rank's failure, on every rank (empty when none failed).

        The success path is one barrier and one int all-reduce on the control group; only after a failure do the
        ranks exchange their messages.

        Raises:
            SyncTimeoutError: a rank did not arrive within `timeout_s` (it is hung or dead), or a previous agreement
                timed out (the ranks cannot agree any more).
        """
        if self.group is None:
            return [failure] if failure is not None else []
        self._check_usable()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            # NOTE: gloo's monitored barrier names the ranks that did not arrive (on rank 0; the others learn that
            # rank 0 gave up); a plain all-reduce would only time out.
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
            flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not flag.item():
                return []
            gathered: list[RankFailure | None] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, failure, group=self.group)
        except RuntimeError as e:
            raise self._timed_out(e, failure) from e
        return [f for f in gathered if f is not None]
