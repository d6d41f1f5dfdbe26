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
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from .errors import RankFailure, SyncError, SyncTimeoutError

__all__ = ["Coordinator", "Rounds", "distributed", "free_port", "own_failure", "rank", "world_size"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def own_failure(stage: str, error: Exception | None) -> RankFailure | None:
    """This rank's record of `error` at `stage`, for an agreement (None when it did not fail)."""
    return None if error is None else RankFailure(rank(), stage, f"{type(error).__name__}: {error}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a one-process group, or a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One group per (training world, timeout, purpose): creating a group is itself a collective, so every WeightSync
# built at the same point on every rank gets the same groups, and repeated builds (`iter_full_weights`) create none.
_GROUPS: dict[tuple[int, float, str], dist.ProcessGroup] = {}


def _control_group(timeout_s: float, purpose: str = "agree") -> dist.ProcessGroup:
    key = (id(dist.group.WORLD), timeout_s, purpose)
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
class _Round:
    """A status round in flight: its collective (None with one rank), the flags it fills, this rank's own number."""

    work: dist.Work | None
    flags: torch.Tensor
    ranks: tuple[int, ...]


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
        # NOTE: the status rounds run on a group of their own: a round that times out (a hung rank) breaks only that
        # group, and the agreement that follows, on `group`, still names the ranks that did not arrive.
        self.rounds_group = _control_group(timeout_s, "rounds") if world_size() > 1 else None
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

    def round(self, failed: bool) -> tuple[int, ...]:
        """One status round: whether each rank has failed so far, on every rank; the failing ranks (empty: go on).

        One all-gather of one byte per rank on a group of its own (no barrier first: it is bounded by the group's
        timeout, `timeout_s`, like every collective of these groups).

        Raises:
            SyncTimeoutError: a rank did not arrive within `timeout_s`, or an earlier agreement timed out.
        """
        return self.finish_round(self.start_round(failed))

    def start_round(self, failed: bool) -> _Round:
        """Start a status round without waiting for it (`finish_round` waits), so that it travels while the caller
        waits for something else (a unit's all-gather)."""
        if self.rounds_group is None:
            return _Round(None, torch.tensor([int(failed)], dtype=torch.uint8), (rank(),))
        self._check_usable()
        flags = torch.zeros(dist.get_world_size(self.rounds_group), dtype=torch.uint8)
        mine = torch.tensor([int(failed)], dtype=torch.uint8)
        work = dist.all_gather_into_tensor(flags, mine, group=self.rounds_group, async_op=True)
        return _Round(work, flags, ())

    def finish_round(self, started: _Round) -> tuple[int, ...]:
        """The failing ranks of a round `start_round` started (empty: go on).

        Raises:
            SyncTimeoutError: a rank did not arrive within `timeout_s`.
        """
        if started.work is None:
            return started.ranks if started.flags.item() else ()
        try:
            started.work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise SyncTimeoutError(
                f"Not every rank reached a status round of this weight sync within {self.timeout_s:g} s "
                f"(SyncConfig.sync_timeout_s) on rank {rank()}: {str(e).rstrip('.! ')}."
            ) from e
        return tuple(r for r, flag in enumerate(started.flags.tolist()) if flag)

    def agree_on(self, stage: str, error: Exception | None) -> list[RankFailure]:
        """`agree` on this rank's outcome of `stage` (`error`: None when it succeeded here)."""
        return self.agree(own_failure(stage, error))

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


class Rounds:
    """One sync's failure state on this rank, shared by the pipeline and the gatherer, and the status rounds every
    rank runs between the units of a gather.

    Why: a collective that one rank leaves (its shard could not be prepared, its engine failed, its all-gather call
    raised) leaves the other ranks waiting in it until a timeout, and a unit gathered with one rank's part missing
    holds undefined values. So before a unit's all-gather starts, every rank says whether its part is ready, and
    before a gathered unit is handed on, every rank says whether it arrived; a failure anywhere (including
    downstream of the gather: the name mapping, the merge, the cast, the engine) stops every rank at the next round,
    together, having handed on only units that every rank gathered whole. See docs/failures.md.

    Args:
        coordinator: the sync's control group; None for a single process.
    """

    def __init__(self, coordinator: Coordinator | None) -> None:
        self.coordinator = coordinator
        self.stage: str | None = None
        self.error: Exception | None = None
        self.stopped_by: tuple[int, ...] = ()
        # A wait of this rank timed out (a rank is hung or dead): no further round can be run.
        self.broken = False

    @property
    def failed(self) -> bool:
        """This rank has failed (it hands nothing more on, and says so at the next round)."""
        return self.error is not None

    @property
    def stopped(self) -> bool:
        """A round found a failed rank (every rank has stopped gathering), or a wait timed out."""
        return bool(self.stopped_by) or self.broken

    def fail(self, stage: str, error: Exception) -> None:
        """Record this rank's first failure (later ones are logged only). A timed-out wait (`SyncTimeoutError`)
        also ends the rounds on this rank: the sync's agreement then names the ranks that did not arrive."""
        self.broken = self.broken or isinstance(error, SyncTimeoutError)
        if self.error is None:
            logger.error(
                "weight sync: this rank failed (%s); every rank stops at the next status round", stage, exc_info=error
            )
            self.stage, self.error = stage, error
        else:
            logger.warning("weight sync: a further failure on this rank (%s): %s", stage, error)
        # NOTE: a stored traceback keeps its frames alive with their locals: here the gatherer's, which hold a
        # unit's buffers and in-flight collectives (measured: a gathered buffer pinned for the whole gather). It
        # was logged above; the error keeps its message and cause.
        error.__traceback__ = None

    def attempt(self, stage: str, work: Callable[[], _T]) -> _T | None:
        """`work()`, or None when it raises (recorded) or this rank has failed already (then it is not run)."""
        if self.error is not None:
            return None
        try:
            return work()
        except Exception as e:
            self.fail(stage, e)
            return None

    def go_on(self) -> bool:
        """A status round: True when no rank has failed; False (on every rank at once) otherwise."""
        return self.finish(self.start())

    def start(self) -> _Round | None:
        """Start a status round carrying whether this rank has failed so far (None: rounds have ended)."""
        if self.stopped or self.coordinator is None:
            return None
        return self.coordinator.start_round(self.failed)

    def finish(self, started: _Round | None) -> bool:
        """Wait for a round `start` started: True when no rank had failed; False (on every rank at once) otherwise."""
        if self.stopped:
            return False
        if started is None:  # a single process
            return not self.failed
        assert self.coordinator is not None
        try:
            self.stopped_by = self.coordinator.finish_round(started)
        except SyncTimeoutError as e:
            self.fail("gather", e)
            return False
        return not self.stopped_by
