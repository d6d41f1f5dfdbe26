"""The sync's own agreement between ranks, bounded in time, on a process group of its own; and the one place
through which every collective of a sync is called (`collective`).

Why a group of its own: the agreement is the one wait the sync adds between ranks, and it must be bounded by the
sync's timeout, not by the training group's (NCCL's default is 10-30 minutes, and a collective that timed out leaves
its group unusable). A gloo group created for the purpose carries `SyncConfig.sync_timeout_s`; a timeout there
breaks only that group, and `monitored_barrier` (gloo) names the ranks that did not arrive. The training group is
never used for agreement, so on GPUs the agreement costs no device synchronisation either.

Every collective of a sync is called through `collective`, under a name declared in `fsdp_sync.faults.COLLECTIVES`
(tests/unit/test_guarded_collectives.py fails on a `torch.distributed` collective called anywhere else). Those on the
sync's own groups run inside `Coordinator.run` (or its agreements), where a raise on one rank destroys the groups for
every rank: the others, inside the same or the next control collective, fail at once instead of at a timeout.

Why one file (over 500 lines): the control groups, the `Coordinator` that runs every agreement and status round on
them, and `Rounds` (one sync's side of those rounds) are one failure protocol: how the groups are aborted and rebuilt,
and the failure a rank leaves in the store, is what every agreement and round reads when a collective raises. Apart,
each part would reach into the others' private state (`_ControlGroups`, `_Round`).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import pickle
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import RankFailure, SyncError, SyncTimeoutError, agreed_error, describe_failures
from .faults import COLLECTIVES, fault_point

__all__ = ["Coordinator", "Rounds", "collective", "distributed", "free_port", "own_failure", "rank", "world_size"]

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
    return None if error is None else RankFailure(rank(), stage, _text(error))


def _text(error: Exception) -> str:
    """`error` as a failure's text: a `SyncError` that already names its failures is said by them, so that the
    message every rank raises does not hold a copy of another sync message inside it."""
    if isinstance(error, SyncError) and error.failures:
        return "; ".join(f.error for f in error.failures)
    return f"{type(error).__name__}: {error}"


def collective(name: str, call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    """`call(*args, **kwargs)`: the `torch.distributed` collective `call`, as the declared collective `name`.

    Why one place: a collective that one rank leaves keeps the others inside it, so each one the sync calls must be
    inside the failure model (docs/failures.md): those on the sync's own groups (`COLLECTIVES[name].group ==
    "control"`) are called only from work that `Coordinator.run` or its agreements run, which destroy the groups for
    every rank when one raises; the weight all-gathers on the training group are joined again with a zero shard
    (`gather.collectives.launch_or_join`). Declaring each one keeps that list in one table, and `call` is looked up
    at the call site, so a test that wraps a `torch.distributed` function reaches the library's calls of it.

    Raises:
        KeyError: `name` is not declared in `fsdp_sync.faults.COLLECTIVES`.
    """
    if name not in COLLECTIVES:
        raise KeyError(f"undeclared collective {name!r}; declared: {sorted(COLLECTIVES)}")
    return call(*args, **kwargs)


def agreed(
    coordinator: Coordinator,
    stage: str,
    work: Callable[[], _T],
    failed: Callable[[Exception | None, list[RankFailure]], SyncError],
) -> _T:
    """`work()` on this rank, then every rank agrees on whether it succeeded everywhere; when it failed on any rank,
    every rank raises `failed(this rank's error or None, the failures)`.

    Why: work before (or after) the gathers that can fail on one rank alone must never leave the other ranks in a
    collective: nobody goes on until all said how it went.
    """
    result: _T | None = None
    error: Exception | None = None
    try:
        result = work()
    except Exception as e:
        error = e
    failures = coordinator.agree_on(stage, error)
    if failures:
        raise failed(error, failures)
    return result  # type: ignore[return-value]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a one-process group, a launcher's rendezvous, a server), below the
    kernel's ephemeral range where the platform says where that is.

    Why below it: a port the kernel hands out for `bind(0)` returns to its ephemeral pool at once, and the next
    socket that binds port 0 or connects out (gloo's pair listeners, a store client, an HTTP request) may be given
    it before the caller listens there: a CI run lost a server test to that (the trainer's weight-transfer port taken
    between the test picking it and the job's trainer listening, EADDRINUSE). The kernel never gives out a port below
    the range by itself; only an explicit bind takes one.
    """
    low = _ephemeral_low()
    if low is not None and low > 2048:
        pick = random.SystemRandom()  # NOTE: not `random`: forked processes share its state and would pick alike
        for _ in range(64):
            port = pick.randrange(max(1024, low - 12000), low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux: `net.ipv4.ip_local_port_range`), None where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# One pair of groups per (training world, timeout): creating a group is itself a collective, so every WeightSync
# built at the same point on every rank gets the same groups, and repeated builds (`iter_full_weights`) create none.
_GROUPS: dict[tuple[int, float], _ControlGroups] = {}
# Where a rank that aborts the control groups leaves its failure for the others (in the training world's store).
_STORE_PREFIX = "fsdp_vllm_sync/control"
# How many coordinators this process made: every rank makes them at the same points (they make groups), so the count
# names one coordinator alike on every rank (the key of its outcome records).
_COORDINATORS = [0]


@dataclass
class _ControlGroups:
    """The sync's two gloo groups for one training world and timeout.

    Attributes:
        agree: the agreements (`Coordinator.agree`, `exchange`).
        rounds: the status rounds (a round that times out breaks only this group; the agreement that follows still
            names the ranks that did not arrive).
        generation: how many times the groups were rebuilt (the same on every rank: they are rebuilt together).
        aborted: once a rank failed inside a control collective: every failure known here (the groups are
            destroyed, every control collective raises until `Coordinator.reopen` rebuilds them).
        own: this rank's own error that aborted them (None where another rank did), raised as this rank's.
    """

    agree: dist.ProcessGroup | None
    rounds: dist.ProcessGroup | None
    generation: int = 0
    aborted: list[RankFailure] | None = None
    own: Exception | None = None


def _open_control_groups(timeout_s: float, generation: int = 0) -> _ControlGroups:
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = _ControlGroups(
        dist.new_group(backend="gloo", timeout=timeout),
        dist.new_group(backend="gloo", timeout=timeout),
        generation,
    )
    if not _GROUPS:
        atexit.register(_destroy_control_groups)
    _GROUPS[(id(dist.group.WORLD), timeout_s)] = groups
    return groups


def _destroy(groups: _ControlGroups) -> None:
    """Destroy both groups now. NOTE: gloo has no abort (`ProcessGroupGloo.abort` and `shutdown` leave its
    connections open: measured); a group's connections close when the group object goes, so torch's registry and
    every reference this module holds are dropped here (a failed collective's traceback holds `groups`, not the
    groups themselves), and the peers inside a collective of it see the connection close at once."""
    for group in (groups.agree, groups.rounds):
        if group is None:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - already destroyed (at exit), or no world left
            logger.debug("fsdp-vllm-sync: could not destroy a control group: %s", e)
    groups.agree = groups.rounds = None


def _destroy_control_groups() -> None:
    """At exit, while the interpreter is still whole: destroy the groups this module made, unless the program already
    destroyed them. NOTE: a gloo group left to interpreter finalisation can abort the process (its worker threads
    release Python-owned tensors after the interpreter is gone: pytorch/pytorch#179291); training scripts often
    end without `destroy_process_group`, and this module's group should not add that risk."""
    for groups in list(_GROUPS.values()):
        if distributed() and groups.aborted is None:
            _destroy(groups)
    _GROUPS.clear()


def _world_store() -> dist.Store | None:
    """The training world's store, where a rank that aborts the control groups says why (None: not reachable)."""
    # NOTE: `_get_default_store` is private, but it is the store every rank of the training world already shares;
    # without it the others still fail at once (the connections close), only without the failing rank's message.
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001 - no default store (a world built without one)
        return None


def _failure_key(timeout_s: float, generation: int, who: int) -> str:
    return f"{_STORE_PREFIX}/{timeout_s:g}/{generation}/failed/{who}"


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

    Must be created at the same point on every rank (it creates process groups) and used at the same points.

    A rank that fails inside a control collective (its own error there, not a timeout) leaves its failure in the
    training world's store and destroys the control groups: the others, inside the same collective, see the
    connection close at once, read why, and destroy theirs too; every rank raises a `SyncError` naming the
    failing rank, and the groups are rebuilt at the start of the next sync (`reopen`), on every rank together. A
    timeout cannot be recovered that way (the rank that did not arrive is hung or dead, and rebuilding a group is a
    collective of every rank of the training world): the ranks raise `SyncTimeoutError` and the job must restart.

    Args:
        timeout_s: the bound on each agreement: how long a rank waits for the others to arrive.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: _ControlGroups | None = None
        self._broken: str | None = None
        _COORDINATORS[0] += 1
        self._index = _COORDINATORS[0]
        # How many times `reopen` ran (once per sync, on every rank): names the sync of an outcome record.
        self._opened = 0
        if world_size() > 1:
            self.reopen()

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._groups.agree if self._groups is not None else None

    @property
    def rounds_group(self) -> dist.ProcessGroup | None:
        return self._groups.rounds if self._groups is not None else None

    def reopen(self) -> None:
        """At the start of a sync, on every rank: the control groups, rebuilt where a rank aborted them in an earlier
        sync (every rank did: they fail together), else the ones already made."""
        if world_size() == 1:
            return
        self._opened += 1
        groups = _GROUPS.get((id(dist.group.WORLD), self.timeout_s))
        if groups is None:
            groups = _open_control_groups(self.timeout_s)
        elif groups.aborted is not None:
            groups = _open_control_groups(self.timeout_s, groups.generation + 1)
            logger.warning("weight sync: the sync's control groups were rebuilt after a rank aborted them")
        self._groups = groups

    def run(self, name: str, work: Callable[[dist.ProcessGroup | None], _T]) -> _T:
        """`work(group)` on every rank, where `group` is the sync's own (None with one process): collectives called
        through `collective` as `name` (declared with `group="control"`). A rank that raises in it aborts the groups
        for all: every rank raises a `SyncError` at once, naming that rank and the collective's stage.

        Why not the training group: torch cannot unblock a rank inside a collective of the training group when
        another rank left it (its only bound is that group's own timeout, 30 minutes by default); these groups are
        destroyed instead, which ends every collective on them at once, and are rebuilt at the next sync.
        """
        spec = COLLECTIVES[name]
        if spec.group != "control":
            raise ValueError(f"collective {name!r} runs on the {spec.group} group, not the sync's own")
        if world_size() == 1:
            return work(None)
        return self._control(lambda groups: work(groups.agree), stage=spec.stage)

    def _control(
        self, work: Callable[[_ControlGroups], _T], failure: RankFailure | None = None, stage: str = "agree"
    ) -> _T:
        """Run `work` (control collectives) on every rank; a rank that raises in it aborts the groups for all.

        Args:
            failure: this rank's own failure of the stage being agreed on (named in a timeout's error).
            stage: the stage every rank names when a rank raises inside `work`.
        """
        groups = self._usable()
        started = time.monotonic()
        try:
            return work(groups)
        except SyncError:
            raise
        except Exception as e:
            error = e
        if isinstance(error, RuntimeError) and time.monotonic() - started >= 0.95 * self.timeout_s:
            raise self._timed_out(error, failure) from error
        raise self._abort(groups, error, failure, stage) from error

    def _usable(self) -> _ControlGroups:
        if self._broken is not None:
            raise SyncTimeoutError(
                f"A previous weight sync timed out ({self._broken}); the ranks can no longer agree: a rank that does "
                "not arrive is hung or dead, and the sync's groups cannot be rebuilt without every rank of the "
                "training world taking part. Restart the job."
            )
        assert self._groups is not None
        if self._groups.aborted is not None:
            raise self._aborted_error(self._groups.aborted, self._groups.own)
        return self._groups

    def _abort(self, groups: _ControlGroups, error: Exception, failure: RankFailure | None, stage: str) -> SyncError:
        """This rank saw a control collective fail (not a timeout): when another rank aborted it, that rank's failure
        is in the training world's store; otherwise the failure is this rank's own, and it leaves it there for the
        others. Either way the groups are destroyed here (so every rank still inside one of their collectives fails
        at once) and rebuilt at the next sync. Without that store (a rank died: rank 0 hosts it) the ranks cannot
        tell a failed rank from a dead one, and the error is final (`SyncTimeoutError`)."""
        store = _world_store()
        try:
            if store is None:
                raise RuntimeError("this training world has no store the ranks share")
            failures = self._peer_failures(store, groups)
            own = None if failures else RankFailure(rank(), stage, _text(error))
            if own is not None:
                store.set(_failure_key(self.timeout_s, groups.generation, rank()), pickle.dumps(own))
        except Exception as e:  # noqa: BLE001 - no store: the ranks can no longer tell why the collective failed
            # Marked aborted all the same: a coordinator built later rebuilds the groups rather than use these.
            logger.error("weight sync: a collective of the sync's own groups raised here (%s)", stage, exc_info=error)
            error.__traceback__ = None
            groups.aborted = [RankFailure(rank(), stage, _text(error))]
            _destroy(groups)
            self._broken = f"{type(error).__name__}: {error}; the training world's store: {type(e).__name__}: {e}"
            return SyncTimeoutError(
                f"A control collective of this weight sync failed on rank {rank()} ({type(error).__name__}: "
                f"{str(error).rstrip('.! ')}), and the training world's store cannot be reached to learn why "
                f"({type(e).__name__}: {e}): a rank has died (rank 0 hosts the store). The sync's groups cannot be "
                "rebuilt without every rank of the training world taking part. Restart the job.",
                failures=(failure,) if failure is not None else (),
            )
        if own is not None:
            logger.error("weight sync: a collective of the sync's own groups raised here (%s); aborting them for "
                         "every rank", stage, exc_info=error)  # fmt: skip
        else:
            # NOTE: this rank only saw the groups close under it (the failing rank logged its traceback): one line.
            logger.warning("weight sync: the sync's control groups were aborted by %s", describe_failures(failures))
        # NOTE: the failed collective's frames (in its traceback) hold its group, whose connections close only when
        # it goes; logged above, the error keeps its message.
        error.__traceback__ = None
        groups.aborted = [own] if own is not None else failures
        groups.own = error if own is not None else None
        _destroy(groups)
        return self._aborted_error(groups.aborted, groups.own)

    def _peer_failures(self, store: dist.Store, groups: _ControlGroups) -> list[RankFailure]:
        """The failures other ranks left when they aborted the groups of this generation (raises where the store
        cannot be reached)."""
        found: list[RankFailure] = []
        for other in range(world_size()):
            key = _failure_key(self.timeout_s, groups.generation, other)
            if other != rank() and store.check([key]):
                found.append(pickle.loads(store.get(key)))
        return found

    def _aborted_error(self, failures: list[RankFailure], local: Exception | None) -> SyncError:
        """The error of an aborted agreement: this rank's own (`SyncStageError`) or `RemoteSyncError`; the caller
        sets `engine` (what each engine holds is the push's account, none of it changed by the agreement)."""
        return agreed_error(
            local,
            failures,
            None,
            how="It failed inside a collective of the sync's own groups and aborted them, so every rank stopped at "
            "once; the sync's control groups are rebuilt at the start of the next sync.",
        )

    def exchange(self, item: object) -> list[object]:
        """Every rank's `item`, on every rank, in rank order (bounded like `agree`; a small object per rank).

        Raises:
            SyncError: on every rank, when a rank's item cannot be pickled (that rank still takes part, so no rank
                waits for one that left).
            SyncError: a rank failed inside the exchange (it raises `SyncStageError`, the others `RemoteSyncError`).
            SyncTimeoutError: as `agree`.
        """
        if world_size() == 1:
            return [item]
        try:
            pickle.dumps(item)
        except Exception as e:  # noqa: BLE001 - any pickling error: the other ranks must still get an answer
            item = _Unsendable(f"{type(item).__name__} cannot be pickled ({type(e).__name__}: {e})")

        def work(groups: _ControlGroups) -> list[object]:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            collective(
                "agree.barrier", dist.monitored_barrier, group=groups.agree, timeout=timeout, wait_all_ranks=True
            )
            fault_point("agree.exchange")
            gathered: list[object] = [None] * dist.get_world_size(groups.agree)
            collective("agree.items", dist.all_gather_object, gathered, item, group=groups.agree)
            return gathered

        gathered = self._control(work)
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

    def _outcome_key(self, who: int, opened: int | None = None) -> str:
        """The store key of rank `who`'s outcome record of the sync `opened` (default: the current one)."""
        sync = self._opened if opened is None else opened
        return f"{_STORE_PREFIX}/{self.timeout_s:g}/outcome/{self._index}/{sync}/{who}"

    def record_outcome(self, outcome: str) -> None:
        """Leave this rank's outcome of the current sync's commit (`fsdp_sync.sync.frame`) in the training world's
        store, before the collective that tells it to the others, so that a rank that fails inside that collective
        still learns it (`learn_outcomes`). A store that cannot be written is logged: the collective still tells."""
        if world_size() == 1:
            return
        store = _world_store()
        try:
            if store is None:
                raise RuntimeError("this training world has no store the ranks share")
            store.set(self._outcome_key(rank()), outcome)
            # NOTE: one key per sync would grow the store for as long as training runs; the one of two syncs ago is
            # read by no rank any more (every rank left that sync before this one's push agreement).
            if self._opened > 2:
                store.delete_key(self._outcome_key(rank(), self._opened - 2))
        except Exception as e:  # noqa: BLE001 - the agreement that follows tells the outcome in the usual case
            logger.warning("weight sync: could not record this rank's commit outcome in the store: %s", e)

    def learn_outcomes(self, wait_s: float) -> dict[int, str] | None:
        """Every other rank's outcome record of the current sync (`record_outcome`), waiting up to `wait_s` for
        each; None where one cannot be read (a rank that never recorded: it died, or no store)."""
        store = _world_store()
        if store is None:
            return None
        found: dict[int, str] = {}
        try:
            for other in range(world_size()):
                if other == rank():
                    continue
                key = self._outcome_key(other)
                store.wait([key], datetime.timedelta(seconds=wait_s))
                found[other] = store.get(key).decode()
        except Exception as e:  # noqa: BLE001 - an outcome not learnt is said as unknown by the caller
            logger.warning("weight sync: could not learn the other ranks' commit outcome: %s", e)
            return None
        return found

    def _timed_out(self, e: RuntimeError, failure: RankFailure | None) -> SyncTimeoutError:
        self._broken = f"{type(e).__name__}: {e}"
        own = f" This rank had failed itself: {failure.describe()}." if failure is not None else ""
        return SyncTimeoutError(
            f"Not every rank reached the end of this weight sync stage within {self.timeout_s:g} s "
            f"(SyncConfig.sync_timeout_s) on rank {rank()}: {str(e).rstrip('.! ')}.{own} A rank that does not arrive "
            "is hung (look for a rank still inside its engine push or a collective) or has died; the ranks cannot "
            "run collectives together any more, and the sync's groups cannot be rebuilt without every rank of the "
            "training world taking part. Restart the job.",
            failures=(failure,) if failure is not None else (),
        )

    def round(self, failed: bool) -> tuple[int, ...]:
        """One status round: whether each rank has failed so far, on every rank; the failing ranks (empty: go on).

        One all-gather of one byte per rank on a group of its own (no barrier first: it is bounded by the group's
        timeout, `timeout_s`, like every collective of these groups).

        Raises:
            SyncTimeoutError: a rank did not arrive within `timeout_s`, or an earlier agreement timed out.
            SyncError: a rank aborted the control groups.
        """
        return self.finish_round(self.start_round(failed))

    def start_round(self, failed: bool) -> _Round:
        """Start a status round without waiting for it (`finish_round` waits), so that it travels while the caller
        waits for something else (a unit's all-gather)."""
        if world_size() == 1:
            return _Round(None, torch.tensor([int(failed)], dtype=torch.uint8), (rank(),))
        mine = torch.tensor([int(failed)], dtype=torch.uint8)

        def launch(groups: _ControlGroups) -> _Round:
            flags = torch.zeros(dist.get_world_size(groups.rounds), dtype=torch.uint8)
            work = collective(
                "round.flags", dist.all_gather_into_tensor, flags, mine, group=groups.rounds, async_op=True
            )
            return _Round(work, flags, ())

        # NOTE: a launch that raises on one rank aborts the groups, so the others, waiting for this round in
        # `finish_round`, fail at once instead of going on without this rank.
        return self._control(launch)

    def finish_round(self, started: _Round) -> tuple[int, ...]:
        """The failing ranks of a round `start_round` started (empty: go on).

        Raises:
            SyncTimeoutError: a rank did not arrive within `timeout_s`.
            SyncError: a rank aborted the control groups while this one waited.
        """
        if started.work is None:
            return started.ranks if started.flags.item() else ()
        try:
            started.work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            # NOTE: a round carries this rank's failure in its flag; its collective fails only when a rank aborted
            # the groups (its failure is in the store) or did not arrive.
            groups, store = self._groups, _world_store()
            try:
                aborted = self._peer_failures(store, groups) if groups is not None and store is not None else []
            except Exception as lost:  # noqa: BLE001 - no store (a rank died): a timeout, as without an abort
                logger.warning("weight sync: the training world's store cannot be reached: %s", lost)
                aborted = []
            if groups is not None and aborted:
                # NOTE: this rank only saw the round close under it (the failing rank logged its traceback).
                logger.warning("weight sync: the sync's control groups were aborted by %s", describe_failures(aborted))
                groups.aborted = aborted
                _destroy(groups)
                raise self._aborted_error(aborted, None) from e
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
            SyncError: a rank failed inside the agreement (it raises `SyncStageError`, the others `RemoteSyncError`).
        """
        if world_size() == 1:
            return [failure] if failure is not None else []

        def work(groups: _ControlGroups) -> list[RankFailure]:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            # NOTE: gloo's monitored barrier names the ranks that did not arrive (on rank 0; the others learn that
            # rank 0 gave up); a plain all-reduce would only time out.
            collective(
                "agree.barrier", dist.monitored_barrier, group=groups.agree, timeout=timeout, wait_all_ranks=True
            )
            fault_point("agree.outcome")
            flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
            collective("agree.flag", dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=groups.agree)
            if not flag.item():
                return []
            gathered: list[RankFailure | None] = [None] * dist.get_world_size(groups.agree)
            collective("agree.items", dist.all_gather_object, gathered, failure, group=groups.agree)
            return [f for f in gathered if f is not None]

        return self._control(work, failure)


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
        # A rank raised inside a round's own collective and aborted the sync's groups (this one or another): the
        # error every rank raises at its next agreement (`Coordinator.agree`, from the aborted groups).
        self.aborted: SyncError | None = None

    @property
    def failed(self) -> bool:
        """This rank has failed (it hands nothing more on, and says so at the next round)."""
        return self.error is not None

    @property
    def stopped(self) -> bool:
        """A round found a failed rank (every rank has stopped gathering), a wait timed out, or a round's own
        collective failed on a rank (the groups are aborted)."""
        return bool(self.stopped_by) or self.broken or self.aborted is not None

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
        try:
            return self.coordinator.start_round(self.failed)
        except SyncTimeoutError as e:
            self.fail("gather", e)
        except SyncError as e:
            self.aborted = e  # logged where the groups were aborted; raised by the agreement that follows
        return None

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
        except SyncError as e:
            self.aborted = e
            return False
        return not self.stopped_by
