"""One trainer rank's share of a routed update (`fsdp_sync.transfer.routes`), over the gloo route group: the
trainer side of `gloo_wire.routed_chunks`. Every trainer rank runs it, the sender inside its round
(`gloo_trainer.GlooTrainerWeightTransferEngine._round`), the other ranks alone."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta

from .gloo_wire import ABORT, DATA, TRAILER, Chunk, plan_chunks, send_to
from .routes import RoutePlan, cut_shape, take

__all__ = ["RouteSender"]

logger = logging.getLogger(__name__)


class RouteSender:
    """One trainer rank's share of a routed update: for every tensor of the stream, the cut each worker receives is
    copied into that worker's current chunk where this rank sends the chunk (`RoutePlan.sources`), and a chunk is
    sent, point to point, when the stream completes it. Every rank runs the same plan over the same stream (each
    holds every full tensor while the gather hands it on), so each chunk is filled and sent by exactly one rank. A
    sparse update's stream is its encoded segments, each item one part per place (`send_parts`), all sent by rank 0.

    NOTE: a rank whose stream fails (its own failure, or another rank's, seen at the gather's next status round)
    sends each worker `ABORT` as its own next chunk to that worker, without waiting: the first chunk a worker still
    waits for is the next own chunk of the rank that sends it, and the others are never received (the transfer is
    set up again after a failed round, and the next update's tag differs).

    Args:
        group: the route group (trainer ranks first, then the workers).
        route: the update's plan.
        rank: this trainer rank.
        wait: waits for one send within the sync's bound.
        answer: the server's answer to the update (the sender's): a failure is raised at the next chunk.
    """

    def __init__(
        self,
        group: dist.ProcessGroupGloo,
        route: RoutePlan,
        rank: int,
        wait: Callable[[Any], None],
        *,
        answer: Future | None = None,
    ) -> None:
        self.group = group
        self.route = route
        self.rank = rank
        self.wait = wait
        self.answer = answer
        # Chunks the stream completed so far (sent by this rank or another).
        self.completed = 0
        self.sent_bytes = 0
        self.worker_bytes = [0] * route.workers  # of `sent_bytes`, what went to each worker
        # Sends never waited for (a failed update's), with their buffers: gloo writes from the buffer for as long as
        # the send is pending, so they are kept until the route group is dropped (`abandoned`).
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, stream: Iterator[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> None:
        """Send this rank's chunks of a dense `stream` (already checked against `meta`): each worker its cut of
        every tensor.

        Raises:
            the stream's error (after the aborts), a send's, or the server's answer.
        """
        route = self.route
        shapes, dtypes = [m.shape for m in meta], [m.dtype for m in meta]
        cuts = [route.cuts_of(w) for w in range(route.workers)]

        def fill(part: torch.Tensor, tensor: torch.Tensor, w: int, i: int) -> None:
            part.view(tensor.dtype).view(cut_shape(tensor.shape, cuts[w][i])).copy_(take(tensor, cuts[w][i]))

        self._send((t for _, t in stream), [route.sizes(w, shapes, dtypes) for w in range(route.workers)], fill)

    def send_parts(self, parts: Iterator[Sequence[torch.Tensor]], sizes: list[list[int]]) -> None:
        """Send this rank's chunks of a stream whose every item differs by place (a sparse update's segments: each
        place's own bytes, `parts[place]`); `sizes[w]`: each item's bytes as worker `w` receives it.

        Raises:
            a send's error, or the server's answer.
        """
        replica = self.route.replica

        def fill(part: torch.Tensor, item: Sequence[torch.Tensor], w: int, i: int) -> None:
            part.copy_(item[w % replica])

        self._send(parts, sizes, fill)

    def _send(self, items: Iterator[Any], sizes: list[list[int]], fill: Callable[[torch.Tensor, Any, int, int], None]) -> None:
        """The route's loop: each item's part for every worker whose current chunk this rank sends is written there
        (`fill(part, item, worker, index)`, `part` the item's `sizes[worker][index]` bytes of that chunk), and a
        chunk is sent once the stream completes it."""
        route, me = self.route, self.rank
        chunks = [plan_chunks(sizes[w], route.buffer_bytes) for w in range(route.workers)]
        following = [0] * route.workers  # each worker's next chunk
        buffers: dict[int, torch.Tensor] = {}
        # Sends on the wire and their buffers, oldest first; at most two chunks per worker wait at once.
        in_flight: deque[tuple[Any, torch.Tensor]] = deque()
        try:
            for i, item in enumerate(items):
                for w in range(route.workers):
                    k = following[w]
                    chunk = chunks[w][k]
                    if route.sources[w][k] == me:
                        buffer = buffers.get(w)
                        if buffer is None:
                            buffer = buffers[w] = torch.empty(chunk.nbytes + TRAILER, dtype=torch.uint8)
                        if sizes[w][i]:
                            offset = chunk.offsets[i - chunk.start]
                            fill(buffer[offset : offset + sizes[w][i]], item, w, i)
                    if i + 1 < chunk.stop:
                        continue
                    following[w] += 1
                    self.completed += 1
                    if route.sources[w][k] != me:
                        continue
                    buffer = buffers.pop(w)
                    buffer[chunk.nbytes] = DATA
                    if self.answer is not None and self.answer.done():
                        self.answer.result()  # the server gave up on this round: say why now
                    if len(in_flight) >= 2 * route.workers:
                        self.wait(in_flight.popleft()[0])
                    in_flight.append((send_to(self.group, buffer, route.senders + w, route.tag), buffer))
                    self.sent_bytes += buffer.numel()
                    self.worker_bytes[w] += buffer.numel()
                del item
            while in_flight:
                self.wait(in_flight.popleft()[0])
        except BaseException:
            self.pending += in_flight
            self._abort(chunks, following)
            raise

    def _abort(self, chunks: list[list[Chunk]], following: list[int]) -> None:
        """Tell each worker the update ends: `ABORT` as this rank's own next chunk to it (not waited for)."""
        route = self.route
        for w in range(route.workers):
            own = [k for k in range(following[w], len(chunks[w])) if route.sources[w][k] == self.rank]
            if not own:
                continue
            chunk = chunks[w][own[0]]
            buffer = torch.empty(chunk.nbytes + TRAILER, dtype=torch.uint8)
            buffer[chunk.nbytes] = ABORT
            try:
                self.pending.append((send_to(self.group, buffer, route.senders + w, route.tag), buffer))
            except Exception as e:  # noqa: BLE001 - the stream's own error is the one raised
                logger.warning("gloo weight transfer: could not tell worker %d to abort the update: %s", w, e)
