"""The gloo backend's trainer side: rank 0 hosts the groups and broadcasts each update's chunks; in a routed dense
update (`fsdp_sync.transfer.routes`) every trainer rank sends the chunks its route names, point to point, to each
worker over the route group (`route`, `RouteSender`); in a routed sparse one rank 0 sends each worker the changes
inside its cut.

Every update, dense, sparse or adapter, is one round of the same shape (`_round`): open the server's weight-update
session (a staged round joins the one already open), announce the update (`/update_weights`, answered on a thread),
send its stream chunk by chunk (`gloo_wire`), wait for the server's answer, close the session (a staged round
leaves it open for `commit`). Staging is a declared capability (`fsdp_sync.transfer.staging.StagedTransfer`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from .gloo_wire import (
    DATA,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    ROUTE_PREFIX,
    STAGE_APPLY,
    STAGE_RECEIVE,
    TRAILER,
    GlooUpdateInfo,
    GlooWorkerInitInfo,
    broadcast,
    gather_to_sender,
    join,
    listen,
    nbytes,
    open_group,
    plan_chunks,
    send_abort,
)
from .gloo_route import RouteSender
from .routes import RoutedPatches, RoutePlan

if TYPE_CHECKING:
    from fsdp_sync.compat.patch_api import EnginePatch

__all__ = ["GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine", "checked"]

logger = logging.getLogger(__name__)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the handshake.

    Attributes:
        master_address: an address of the trainer's sender that the vLLM workers can reach.
        master_port: a free TCP port there.
        world_size: 1 (the sender) + the server's worker count (`/get_world_size`).
        buffer_bytes: chunk size on the wire and on both sides' memory.
        timeout_s: bound on every collective of the transfer (and the rendezvous).
        deadline: `time.monotonic()` by which the handshake must have ended (the sync's own bound; None: `timeout_s`
            alone). Trainer side only.
        route_senders: the trainer ranks that send routed updates (each joins the route group); 0: no route group.
        host: the store the sender listens on, made before the handshake (`listen`; None: made by it). Trainer side
            only: a routed push's other ranks connect to it before the sender's handshake begins.
    """

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    deadline: float | None = None
    route_senders: int = 0
    host: Any = None

    @property
    def route_world(self) -> int:
        """The route group's size: every trainer rank that sends, and every worker."""
        return self.route_senders + self.world_size - 1


def _first_failure(futures: Sequence[Future], timeout_s: float, what: str) -> None:
    """Wait for all `futures`, raising the first exception as soon as any raises (not after the others)."""
    done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        future.result()
    if pending:
        raise TimeoutError(f"{what} did not complete within {timeout_s:.1f} s")


def _left(timeout_s: float, deadline: float | None) -> float:
    """Seconds a wait may take: `timeout_s`, or less where `deadline` (`time.monotonic()`) comes first.

    NOTE: never 0: torch reads a zero timeout as "no timeout" (`kNoTimeout`); a passed deadline gives 1 ms.
    """
    left = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
    return max(left, 1e-3)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the group and broadcasts; other ranks only iterate the source (their collectives).

    Every wait is bounded by `timeout_s`, and by the sync's deadline where one is given (`bound`); a failure of the
    server's side of a round (its HTTP answer) is raised as soon as it arrives rather than after the broadcast times
    out. `shutdown` closes the transfer at once: the group port is free when it returns.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroupGloo | None = None
        # The rendezvous store this sender hosts (`listen`): only this attribute holds it.
        self._host: dist.TCPStore | None = None
        # `time.monotonic()` by which every wait of the current round ends (None: `timeout_s` alone).
        self.deadline: float | None = None
        # Chunks of data broadcast in the current round (0 until one is): whether the server can hold anything new.
        self.data_chunks = 0
        # Bytes this rank put on the wire in the current sync (its share, in a routed one; the writer zeroes both
        # counts at each sync), and of them, what went to each worker (a broadcast's chunk: to every worker).
        self.sent_bytes = 0
        self.worker_bytes: list[int] = []
        # Staged rounds (the writer sets it): each update is received into the server's host memory and written only
        # at `commit`, which the writer calls with the server paused.
        self.staged = False
        # A weight-update session is open on the server (staged rounds keep it open until `commit`).
        self._session = False
        # Every trainer rank and every worker (routed updates); None where there is no route group.
        self.route_group: dist.ProcessGroupGloo | None = None
        # A failed routed update's sends, never waited for (`RouteSender.pending`): kept until the group goes.
        self.abandoned: list[tuple[Any, torch.Tensor]] = []

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource.")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            buffer_bytes=init_info.buffer_bytes,
            timeout_s=init_info.timeout_s,
        )
        # NOTE: vLLM 0.34's base class takes `rank` (0.28-0.33 do not); set here for every version.
        engine.rank = init_info.rank
        engine.deadline = init_info.deadline
        if not engine.is_sender:
            if init_info.route_senders:
                # NOTE: the sender hosts the store; this rank connects as a client (retrying until it listens).
                address, port, timeout_s = init_info.master_address, init_info.master_port, init_info.timeout_s
                timeout_s = _left(timeout_s, init_info.deadline)
                engine.route_group = open_group(
                    address, port, init_info.rank, init_info.route_world, timeout_s, prefix=ROUTE_PREFIX
                )
            return engine
        try:
            engine._handshake(init_info)
        except BaseException:
            # The failed handshake's traceback keeps `engine`: close the port now, not when the traceback goes.
            engine.shutdown()
            raise
        return engine

    def _handshake(self, init_info: GlooTrainerInitInfo) -> None:
        """Host the rendezvous, ask the server's workers to join it, and join it (rank 0)."""
        worker_info = GlooWorkerInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            buffer_bytes=init_info.buffer_bytes,
            timeout_s=init_info.timeout_s,
            route_senders=init_info.route_senders,
            route_world=init_info.route_world,
        )
        address, port, world, timeout_s = (
            init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_s
        )  # fmt: skip
        self._host = init_info.host if init_info.host is not None else listen(address, port, world, timeout_s)
        # NOTE: joined here, before the thread: a client that connects while its host is being closed would retry
        # for `timeout_s`; connected, its rendezvous fails as soon as the host goes.
        joined = join(address, port, world, timeout_s)
        # The workers block in the rendezvous while answering the init request, so both run at once. The group is
        # opened on a daemon thread: if the server refuses the init, the error is raised at once, and closing the
        # store (`shutdown`) ends the abandoned rendezvous at once too.
        group: Future = Future()
        # NOTE: the workers open the route group after the main one; so does this thread, through a store client
        # of its own (one client is not shared between rendezvous).
        route: Future = Future()

        def open_sender() -> None:
            # Each group's failure goes to its own future; a failed main group fails the route group too.
            for future, opened in ((group, lambda: open_group(address, port, 0, world, timeout_s, store=joined)),
                                   (route, open_route)):  # fmt: skip
                try:
                    future.set_result(opened())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    future.set_exception(e)
                    if not route.done():
                        route.set_exception(e)
                    return

        def open_route() -> dist.ProcessGroupGloo | None:
            if not init_info.route_senders:
                return None
            store = join(address, port, world, timeout_s)
            return open_group(address, port, 0, init_info.route_world, timeout_s, store=store, prefix=ROUTE_PREFIX)

        threading.Thread(target=open_sender, name="fvs-gloo-rendezvous", daemon=True).start()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.init_weight_transfer_engine, asdict(worker_info))
            wait_s = _left(init_info.timeout_s + 10, self.deadline)
            _first_failure([answer, group, route], wait_s, "the gloo weight-transfer handshake")
        finally:
            # Never join the request thread here: a server that does not answer is not waited for past the bound.
            pool.shutdown(wait=False)
        self.group = group.result()
        self.route_group = route.result()

    def bound(self, deadline: float | None) -> None:
        """End every wait of the next rounds by `deadline` (`time.monotonic()`; None: `timeout_s` alone)."""
        self.deadline = deadline

    def _wait(self, work: Any) -> None:
        """Wait for one broadcast, within the round's bound."""
        work.wait(timedelta(seconds=_left(self.timeout_s, self.deadline)))

    def send_weights(self, route: RoutePlan | None = None) -> None:
        """One dense update: the source's tensors, in its metadata's order; with `route`, each worker's cuts, sent
        by every trainer rank as the route says (this rank's share: `RouteSender`). A rank that is not the sender
        sends its share of a routed update, and only iterates the source of any other."""
        from fsdp_sync.compat.weight_transfer import source_metadata, source_tensors

        source = self.source
        assert source is not None
        meta = source_metadata(source)
        if not self.is_sender:
            if route is None:
                for _ in source_tensors(source):
                    pass
                return
            self._route_stream(source_tensors(source), meta, route)
            return
        update = _announce(meta, route=route.as_json() if route is not None else None)
        stream = source_tensors(source)
        if route is None:
            self._round(update, lambda answer: self._broadcast_stream(stream, meta, answer))
        else:
            staged = self._staged(update)
            self._round(update, lambda answer: self._route_stream(stream, meta, route, answer, staged))

    def send_patches(self, patches: Sequence[EnginePatch], routed: RoutedPatches | None = None) -> int:
        """One sparse update: announce the patched tensors and their counts, and send the encoded patches (the
        chunks of `plan_chunks` over each tensor's three segments): broadcast whole, or with `routed`
        (`routes.route_patches`), each worker only the changes inside its cut, point to point over the route group.
        Returns the bytes this rank sent."""
        from fsdp_sync.patch_codec import encode_patch

        meta = [ParamMeta(p.name, p.dtype, tuple(p.shape)) for p in patches]
        counts = [p.indices.numel() for p in patches]
        # NOTE: the workers write a sparse update only once every chunk arrived; before that the engine is unchanged.
        if routed is not None:
            if self.route_group is None:
                raise RuntimeError("a routed sparse update, but this transfer has no route group")
            route, encoded = routed
            shapes, dtypes = [m.shape for m in meta], [m.dtype for m in meta]
            sizes = [route.sizes(w, shapes, dtypes) for w in range(route.workers)]
            items = (segments for tensor in encoded for segments in zip(*tensor, strict=True))
            update = _announce(meta, counts=counts, route=route.as_json())
            staged = self._staged(update)
            self._round(
                update, lambda answer: self._route_parts(items, sizes, route, answer, staged), written_whole=True
            )
            return sum(sum(s) for s in sizes)
        update = _announce(meta, counts=counts)
        segments: list[ParamMeta] = []
        tensors: list[tuple[str, torch.Tensor]] = []
        for p in patches:
            for part, raw in zip(("blocks", "indices", "values"), encode_patch(p), strict=True):
                segments.append(ParamMeta(f"{p.name}:{part}", torch.uint8, (raw.numel(),)))
                tensors.append((segments[-1].name, raw))
        if [m.shape[0] for m in segments] != update.segment_sizes():
            raise AssertionError("sparse update: the encoded segments disagree with GlooUpdateInfo.segment_sizes")
        self._round(update, lambda answer: self._broadcast_stream(tensors, segments, answer), written_whole=True)
        return sum(m.shape[0] for m in segments)

    def send_adapter(self, tensors: Sequence[tuple[str, torch.Tensor]], adapter: dict[str, Any]) -> int:
        """One adapter update: announce the adapter's tensors (PEFT names) and its id, name and config, broadcast the
        tensors; the server builds the adapter as it arrives (never staged as weights are) and keeps it beside the
        versions it serves until `publish_adapter`. Returns the bytes broadcast."""
        meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors]
        self._round(_announce(meta, adapter=adapter), lambda answer: self._broadcast_stream(tensors, meta, answer))
        return sum(nbytes(m.dtype, m.shape) for m in meta)

    def publish_adapter(self, name: str, *, fresh: bool) -> None:
        """The adapter version `name`, sent before, becomes one requests may name (every worker, and the API
        server's list); a round without tensors. `fresh`: this trainer's first publish (the versions the server
        served before are retired: their names may be this trainer's next ones, with other contents)."""
        self._round(_announce([], publish=name, fresh=fresh), lambda answer: self._broadcast_stream([], [], answer))

    def _staged(self, update: GlooUpdateInfo) -> bool:
        """Whether `update` is staged: an adapter is built on arrival (never staged as weights are), and a publish
        carries no tensors."""
        return self.staged and update.adapter is None and update.publish is None

    def _round(self, update: GlooUpdateInfo, send: Callable[[Future], None], *, written_whole: bool = False) -> None:
        """One round, whatever the update: open the server's session (a staged round joins the one already open),
        announce `update` on a thread, send its data (`send(answer)`: broadcast or routed, the server's answer
        checked at every chunk), wait for the answer, close the session (a staged round leaves it open for
        `commit`). `written_whole`: the server writes the update only once all of it arrived.

        Raises:
            the stream's own error (after aborting the update on the workers), the server's answer, or the group's.
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (trainer_init failed or was not called).")
        staged = self._staged(update)
        if staged:
            update.stage = STAGE_RECEIVE
        self.data_chunks = 0
        try:
            if not self._session:
                self.client.start_weight_update()
                self._session = True
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                answer = pool.submit(self.client.update_weights, asdict(update))
                send(answer)
                if written_whole and not staged:
                    self.data_chunks = max(self.data_chunks, 1)
                _first_failure([answer], _left(self.timeout_s, self.deadline), "the server's answer to /update_weights")
            finally:
                # Never join the request thread here: after a failed broadcast the server may still be waiting.
                pool.shutdown(wait=False)
        except BaseException:
            # NOTE: a round written on arrival leaves no session of this engine's to keep: the caller closes the
            # server's (it may still be open there). A staged one keeps the session of the rounds before it, for the
            # writer to abandon.
            if not staged:
                self._session = False
            raise
        if not staged:
            self._session = False
            self.client.finish_weight_update()

    def _broadcast_stream(self, source: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta], answer: Future) -> None:
        """Pack the stream into chunks and broadcast each; one chunk on the wire while the next one fills. A failure
        of the stream itself aborts the update on the workers (the chunk they expect next, marked `ABORT`)."""
        assert self.group is not None
        sizes = [nbytes(m.dtype, m.shape) for m in meta]
        stream = checked(source, meta)
        # The broadcast on the wire and its buffer (kept alive until the broadcast is through).
        in_flight: tuple[Any, torch.Tensor] | None = None
        for chunk in plan_chunks(sizes, self.buffer_bytes):
            buffer = torch.empty(chunk.nbytes + TRAILER, dtype=torch.uint8)
            try:
                for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                    _, tensor = next(stream)
                    buffer[offset : offset + sizes[i]].copy_(tensor.reshape(-1).view(torch.uint8))
                    del tensor
            except Exception:
                try:
                    send_abort(self.group, buffer, chunk, in_flight and in_flight[0], self._wait)
                except Exception as e:  # noqa: BLE001 - the stream's own error is the one raised
                    logger.warning("gloo weight transfer: could not tell the server to abort the update: %s", e)
                raise
            buffer[chunk.nbytes] = DATA
            if answer.done():
                answer.result()  # the server gave up on this round: say why now, not after a broadcast timeout
            if in_flight is not None:
                self._wait(in_flight[0])
            in_flight = (broadcast(self.group, buffer), buffer)
            self.sent_bytes += buffer.numel()
            self.worker_bytes = [b + buffer.numel() for b in self._workers_bytes()]
            if not self.staged:  # a staged chunk is kept in the server's host memory, not written
                self.data_chunks += 1
        if in_flight is not None:
            self._wait(in_flight[0])
        for name, _ in stream:  # the metadata was shorter than the stream
            raise ValueError(f"the weight stream yielded {name!r} after the {len(meta)} announced tensors")

    def _route_stream(
        self,
        source: Iterable[tuple[str, torch.Tensor]],
        meta: list[ParamMeta],
        route: RoutePlan,
        answer: Future | None = None,
        staged: bool = False,
    ) -> None:
        """This rank's share of a routed update (`RouteSender`), the server's answer (the sender's) checked at every
        chunk; the chunks the stream completed are counted (`data_chunks`: any rank may have sent them)."""
        if self.route_group is None:
            raise RuntimeError("a routed update, but this rank joined no route group (trainer_init without it)")
        sender = RouteSender(self.route_group, route, self.rank, self._wait, answer=answer)
        try:
            sender.send(checked(source, meta), meta)
        finally:
            self._sent(sender, staged)

    def _route_parts(
        self,
        items: Iterator[Sequence[torch.Tensor]],
        sizes: list[list[int]],
        route: RoutePlan,
        answer: Future,
        staged: bool,
    ) -> None:
        """This rank's chunks of a routed update whose items differ by place (`RouteSender.send_parts`)."""
        assert self.route_group is not None
        sender = RouteSender(self.route_group, route, self.rank, self._wait, answer=answer)
        try:
            sender.send_parts(items, sizes)
        finally:
            self._sent(sender, staged)

    def _sent(self, sender: RouteSender, staged: bool) -> None:
        """A routed round's count, whatever its end: its unfinished sends kept, its bytes and chunks added."""
        self.abandoned += sender.pending
        self.sent_bytes += sender.sent_bytes
        self.worker_bytes = [b + s for b, s in zip(self._workers_bytes(len(sender.worker_bytes)), sender.worker_bytes)]
        if not staged:
            self.data_chunks += sender.completed

    def _workers_bytes(self, workers: int | None = None) -> list[int]:
        """This push's bytes to each worker so far (sized to the server's workers at its first round)."""
        if self.worker_bytes:
            return self.worker_bytes
        if workers is None:  # a broadcast: every member of the transfer group but this sender is a worker
            assert self.group is not None
            workers = self.group.size() - 1
        return [0] * workers

    def gather_answers(self, request: Callable[[], Any], what: str) -> list[bytes]:
        """Every server worker's answer, sent to this rank over the transfer group while `request` (the call that
        makes each worker send it: `fsdp_sync.transfer.questions`) runs; in transfer-rank order, this rank's own left
        out. The request's own failure (a server whose workers cannot answer) is raised at once, not after the
        group's timeout.

        Raises:
            RuntimeError: the transfer is not initialized.
            TimeoutError: not every worker answered within the bound (`what` names what was awaited).
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (trainer_init failed or was not called).")
        group = self.group
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            answer = pool.submit(request)
            gathered = pool.submit(gather_to_sender, group, b"", self._wait)
            _first_failure([answer, gathered], _left(self.timeout_s + 10, self.deadline), what)
        finally:
            pool.shutdown(wait=False)
        payloads = gathered.result()
        assert payloads is not None
        return payloads[1:]  # rank 0 is this sender

    # --- staging (`fsdp_sync.transfer.staging.StagedTransfer`) ---

    @property
    def pending(self) -> bool:
        """Staged rounds wait for `commit` (the server's update session is open)."""
        return self.staged and self._session

    def commit(self) -> None:
        """Write every staged round into the engine and close the session (call it with the server paused).

        Raises:
            whatever the server answered: a staged round that did not arrive whole leaves the engine unchanged.
        """
        if not self._session:
            return
        apply = GlooUpdateInfo(names=[], dtype_names=[], shapes=[], stage=STAGE_APPLY)
        self.data_chunks = 1  # from here on, the engine may hold new weights
        self.client.update_weights(asdict(apply))
        self._session = False
        self.client.finish_weight_update()

    def abandon(self) -> None:
        """After a failed round: the server's session is closed by whoever opens the next (the writer)."""
        self._session = False

    def shutdown(self) -> None:
        """Close the transfer now: the group port is free when this returns (this engine held the store's only
        reference), and the group's connections close once nothing else holds the group (gloo groups have no
        explicit close). The server's workers leave the group when the next handshake replaces it."""
        self.group = None
        self.route_group = None
        self._host = None
        self.abandoned = []


def _announce(meta: Sequence[ParamMeta], **fields: Any) -> GlooUpdateInfo:
    """The update that announces `meta`'s tensors (vLLM dtype names), with `fields` (counts, adapter)."""
    return GlooUpdateInfo(
        names=[m.name for m in meta],
        dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
        shapes=[list(m.shape) for m in meta],
        **fields,
    )


def checked(source: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, checked tensor by tensor against what the workers were told (they size their buffers from it)."""
    it = iter(source)
    for expected in meta:
        try:
            name, tensor = next(it)
        except StopIteration:
            raise ValueError(
                f"the weight stream ended before {expected.name!r}; the server was told to expect {len(meta)} tensors"
            ) from None
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"the weight stream disagrees with the announced metadata: expected {expected.name!r} "
                f"{expected.dtype} {tuple(expected.shape)}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        yield name, tensor
    yield from it
