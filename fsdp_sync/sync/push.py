"""The push of one sync: the stream handed to the engine writer, the patches written after it, the push finished,
and every rank agreeing on the outcome. A rank's role is decided once, when the sync is built: it writes into an
engine (`_Writing`: colocated ranks, the server's sender), or only runs its share of the gathers (`_Draining`: the
other ranks in server mode).

NOTE: the gather inside the stream is a sequence of collectives that every rank runs, with a status round before
each unit's all-gather and before each gathered unit is handed on (`distributed.Rounds`). When anything on this rank
fails part-way (its gather work, the mapping, the merge, the cast, the engine, the transport), the writer stops
consuming and this rank says so at the next round, where every rank stops; units handed on before it were gathered
whole on every rank. Then all ranks agree on the outcome, on a group of their own and within `sync_timeout_s`, so a
failure on any rank is raised on every rank and none blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch

from fsdp_sync.compat.manifest import PlannedTensor

from ..distributed import Coordinator, Rounds
from ..errors import EngineState, StreamInterrupted, SyncError, SyncTimeoutError, agreed_error
from ..faults import fault_point
from ..gather.base import Gatherer
from ..versions import VersionStamps
from ..writers.base import EngineWriter, PatchWriter, SharedWriter, VersionedWriter
from .select import Payload
from .stream import IncompleteSyncError, StreamPass, SyncPlan, WeightStream
from .verify import EngineDigests

__all__ = ["Push"]


class _Writing:
    """The role of a rank that writes into an engine."""

    own_engine = True

    def __init__(self, writer: EngineWriter) -> None:
        self.writer = writer
        self.patches = writer if isinstance(writer, PatchWriter) else None
        self.versions = writer if isinstance(writer, VersionedWriter) else None
        self.stamps = VersionStamps()
        self.announced: tuple[PlannedTensor, ...] = ()
        # The weight version this rank's engine is served under, as the last commit stamped it.
        self.served: str | None = None

    def unchanged(self) -> EngineState | None:
        return EngineState("unchanged")

    def announce(self, tensors: tuple[PlannedTensor, ...], rounds: Rounds) -> None:
        """Transports that announce tensors announce this sync's (a delta selection); local work, so a failure stops
        every rank at the gather's first round."""
        if tensors != self.announced:
            rounds.attempt("push", lambda: self.writer.prepare(tensors))
            self.announced = () if rounds.failed else tensors

    def write(self, stream: Iterator[tuple[str, torch.Tensor]], rounds: Rounds, payload: Payload) -> EngineState:
        rounds.attempt("push", lambda: fault_point("write"))  # the push starts
        if rounds.failed:
            return EngineState("unchanged")
        if payload.patches is not None and not payload.whole:
            # Every tensor travels as patches: no stream is written (an empty reload would still touch every layer).
            try:
                for _ in stream:
                    pass
            except StreamInterrupted:
                return EngineState("unchanged")
            return EngineState("current")
        try:
            self.writer.write(_faulted(stream))
        except Exception as e:
            if not isinstance(e.__cause__, StreamInterrupted) and not isinstance(e, StreamInterrupted):
                rounds.fail("push", e)  # the engine or the transport itself
            return e.engine if isinstance(e, SyncError) and e.engine is not None else EngineState("undefined")
        try:
            leftover = sum(1 for _ in stream)  # a writer that returned early leaves the rest, which is counted
        except StreamInterrupted:
            leftover = 0
        if rounds.error is None and leftover:
            rounds.fail("push", IncompleteSyncError(f"{self.writer.kind} stopped {leftover} tensor(s) before the end"))
        return EngineState("current")

    def finish(self, rounds: Rounds, payload: Payload, engine: EngineState | None) -> EngineState | None:
        """The patches (a sparse sync), then the end of the push (its weight version is stamped by `commit`, once
        every rank agreed)."""
        if payload.patches and rounds.error is None and not rounds.stopped:
            try:
                fault_point("write.patches")
                assert self.patches is not None, "a sparse payload for a writer that writes no patches"
                self.patches.write_patches(payload.patches)
            except Exception as e:
                engine = e.engine if isinstance(e, SyncError) and e.engine is not None else _unpatched(payload.whole)
                rounds.fail("push", e)
        if rounds.error is None and not rounds.stopped:
            try:
                fault_point("write.finish")
                self.writer.finish()
            except Exception as e:
                # NOTE: a writer whose finish writes (a staged server push, written under its pause) says what the
                # engine holds after it failed; the write's own account ("current") no longer stands.
                if isinstance(e, SyncError) and e.engine is not None:
                    engine = e.engine
                rounds.fail("push", e)
        return engine

    def commit(self) -> str | None:
        """Stamp the engine's weight version (where it keeps one): the push is now the one it holds. Returns the
        version as stamped (a writer may add its label; None where the engine keeps none)."""
        if self.versions is None:
            return None
        version = self.stamps.next()
        self.served = self.versions.stamp(version) or version
        return self.served


class _Draining:
    """The role of a rank that writes into no engine: it runs its share of the gathers (their figures are its own)."""

    own_engine = False
    versions = None
    served = None

    def unchanged(self) -> EngineState | None:
        return None

    def announce(self, tensors: tuple[PlannedTensor, ...], rounds: Rounds) -> None:
        pass

    def write(self, stream: Iterator[tuple[str, torch.Tensor]], rounds: Rounds, payload: Payload) -> None:
        try:
            for _ in stream:
                pass
        except StreamInterrupted:
            pass  # recorded in `rounds`
        return None

    def finish(self, rounds: Rounds, payload: Payload, engine: EngineState | None) -> EngineState | None:
        return engine

    def commit(self) -> str | None:
        return None


class _Sharing(_Draining):
    """The role of a rank that writes into no engine but sends its share of each push (`SharedWriter`: a server's
    routed updates); its share's failure stops every rank at the gather's next round, as a writer's does."""

    def __init__(self, writer: SharedWriter) -> None:
        self.writer = writer
        self.announced: tuple[PlannedTensor, ...] = ()

    def announce(self, tensors: tuple[PlannedTensor, ...], rounds: Rounds) -> None:
        """The selection is announced here too: this rank's share is planned over it."""
        if tensors != self.announced:
            rounds.attempt("push", lambda: cast(EngineWriter, self.writer).prepare(tensors))
            self.announced = () if rounds.failed else tensors

    def write(self, stream: Iterator[tuple[str, torch.Tensor]], rounds: Rounds, payload: Payload) -> None:
        if rounds.failed or (payload.patches is not None and not payload.whole):
            return super().write(stream, rounds, payload)
        try:
            self.writer.share(_faulted(stream))
        except StreamInterrupted:
            pass  # recorded in `rounds`
        except Exception as e:
            if not isinstance(e.__cause__, StreamInterrupted):
                rounds.fail("push", e)
        return super().write(stream, rounds, payload)  # what a share left of the stream


class Push:
    """Runs the push of each sync for this rank, in its role.

    Args:
        writer: the engine transport.
        stream: the sync's data path.
        gatherer: the stream's gatherer (whether its tensors outlive the next unit).
        coordinator: the sync's control plane.
    """

    def __init__(self, writer: EngineWriter, stream: WeightStream, gatherer: Gatherer, coordinator: Coordinator) -> None:
        # NOTE: the one place the sync reads `writer.pushes`.
        self.shared = writer if isinstance(writer, SharedWriter) and writer.shares else None
        self.role: _Writing | _Draining
        if writer.pushes:
            self.role = _Writing(writer)
        else:
            self.role = _Sharing(self.shared) if self.shared is not None else _Draining()
        self.stream = stream
        self.coordinator = coordinator
        self.copy = writer.retains_tensors and not gatherer.tensors_outlive_step

    @property
    def own_engine(self) -> bool:
        return self.role.own_engine

    @property
    def versions(self) -> VersionedWriter | None:
        """The engine's weight versions, where this rank writes into an engine that keeps them."""
        return self.role.versions

    def unchanged(self) -> EngineState | None:
        """This rank's engine when nothing was sent (None: it has none)."""
        return self.role.unchanged()

    def planned(self, tensors: tuple[PlannedTensor, ...]) -> None:
        """The plan announced these (its `prepare`), for the next push to know what is announced already."""
        if isinstance(self.role, (_Writing, _Sharing)):
            self.role.announced = tensors

    def run(
        self, plan: SyncPlan, payload: Payload, digests: EngineDigests | None
    ) -> tuple[EngineState | None, StreamPass]:
        """Hand the stream to the writer, finish this rank's share of the gathers whatever happened, write the
        patches, finish, then agree with every rank on the outcome before anyone goes on.

        With patches, the payload's whole part is sent and the rest of what it gathers (the patched tensors, for
        `verify`'s digests) is hashed and dropped.

        Returns:
            this rank's engine state (None on a rank without an engine), and the pass (its figures).

        Raises:
            SyncError: on every rank when any rank failed, saying what this rank's engine holds.
        """
        rounds = Rounds(self.coordinator)
        self.role.announce(payload.whole, rounds)
        if self.shared is not None:
            self._hand_ticket(rounds, payload)
        # With patches, only the whole part is sent; the rest is gathered for its digests (verify) and dropped.
        send = frozenset(t.name for t in payload.whole) if payload.patches is not None else None
        run = self.stream.open(plan, rounds, select=payload.gather, copy=self.copy, digests=digests, send=send)
        stream: Iterator[tuple[str, torch.Tensor]] = iter(run)
        engine: EngineState | None = None
        try:
            engine = self.role.write(stream, rounds, payload)
            run.drain()
        except SyncTimeoutError as e:
            e.engine = engine
            self._forget_route()
            raise
        engine = self.role.finish(rounds, payload, engine)
        try:
            failures = self.coordinator.agree_on(rounds.stage or "push", rounds.error)
        except SyncError as e:
            e.engine = e.engine or engine
            self._forget_route()
            raise
        if failures:
            self._forget_route()
            raise agreed_error(rounds.error, failures, engine)
        return engine, run

    @property
    def sent_bytes(self) -> int | None:
        """Bytes this rank put on the transfer's wire in its last push (a shared writer's count; None elsewhere)."""
        return self.shared.sent_bytes if self.shared is not None else None

    @property
    def worker_bytes(self) -> tuple[int, ...]:
        """Of `sent_bytes`, what each server worker received from this rank (a shared writer's; empty elsewhere)."""
        return self.shared.worker_bytes if self.shared is not None else ()

    def _forget_route(self) -> None:
        """After a failed push, on every rank: a shared push's transfer is set up again at the next one."""
        if self.shared is not None:
            self.shared.route_failed()

    def _hand_ticket(self, rounds: Rounds, payload: Payload) -> None:
        """The pushing rank's plan of this push, on every rank (`SharedWriter`), before the stream's first round.
        A push that writes no stream (only patches), or whose plan could not be made, is not shared.

        NOTE: every rank takes part in the broadcast whatever failed before it, so none waits for another there.
        """
        assert self.shared is not None
        ticket = None
        if self.role.own_engine and not rounds.failed and (payload.patches is None or payload.whole):
            ticket = rounds.attempt("push", self.shared.route_ticket)
        self.shared.take_ticket(self.coordinator.broadcast(ticket))

    def commit(self) -> str | None:
        """The commit point of a sync every rank agreed on (and verified), on this rank: its engine's weight version
        stamped where it writes into one (`frame.SyncFrame`). Returns the version stamped.

        Raises:
            whatever the stamp raised: the version did not move (a writer that cannot tell reads it back).
        """
        return self.role.commit()

    @property
    def served(self) -> str | None:
        """The weight version this rank's engine is served under, as the last commit stamped it (None: none yet,
        a rank without an engine, or an engine without versions)."""
        return self.role.served


def _unpatched(whole: Sequence[PlannedTensor]) -> EngineState:
    """The engine after a sparse sync whose patches failed without the writer's account: the tensors sent whole
    hold their new values, the patched ones their previous or new ones (patches are written element by element)."""
    if not whole:
        return EngineState("unchanged", note="the sync's patches were not written")
    return EngineState("mixed", note="the tensors sent whole hold their new values, the patched ones old or new ones")


def _faulted(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as the writer takes it, with the `write` fault point at every tensor."""
    for name, tensor in stream:
        fault_point("write", name=name)
        yield name, tensor
