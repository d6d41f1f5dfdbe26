"""The gloo backend's wire format, shared by both ends: chunks, their status trailer, the receive loop, the abort.

Both sides compute the same chunking from the announced metadata (`GlooUpdateInfo`), so nothing but bytes crosses
the group:
- init: the trainer's sender (rank 0) hosts a TCPStore at `master_address:master_port` (`listen`); each vLLM worker
  joins a standalone gloo group of `1 + workers` ranks (`open_group`, worker ranks from `rank_offset`), independent of
  any default group.
- one update: the tensors, in the announced order, packed into chunks of at most `buffer_bytes` (`plan_chunks`; a
  larger tensor travels alone), each chunk one gloo broadcast from rank 0.
- every chunk ends with a status trailer (`DATA` or `ABORT`, padded to `ALIGN`): when the trainer's own stream fails
  part-way, the sender broadcasts the chunk the workers expect next marked `ABORT` (`send_abort`), and the workers'
  receive loop (`received_chunks`) raises `UpdateAborted` at once instead of waiting for the timeout.
- a sparse update (`counts` given): each tensor travels as three segments (`GlooUpdateInfo.segment_sizes`: changes
  per block, low index bits, values; `fsdp_sync.patch_codec`), chunked the same way.
- a routed dense update (`route` given, `fsdp_sync.transfer.routes`): a second group, the route group, of every
  trainer rank and every worker (`route_senders` trainer ranks first); each worker receives its own chunks, of its
  cut of each tensor, point to point from the trainer rank the route names (`send_to`, `routed_chunks`), with the
  same trailer. A trainer rank whose stream stops sends each worker `ABORT` as its own next chunk to that worker
  (the first chunk a worker still waits for is always such a chunk of some rank). A routed sparse update (`route`
  and `counts`): each worker the segments of the changes inside its cut (the route's `counts` for its place), all
  from rank 0.
- answers (`gather_to_sender`): the other way, each worker's few bytes (a JSON answer) to rank 0: every worker of
  every data-parallel replica answers (`fsdp_sync.transfer.questions`, `Route.EVERY_REPLICA`).
"""

from __future__ import annotations

import math
import re
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = [
    "ABORT",
    "ALIGN",
    "DATA",
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_TIMEOUT_S",
    "STAGE_APPLY",
    "STAGE_RECEIVE",
    "TRAILER",
    "Chunk",
    "GlooUpdateInfo",
    "GlooWorkerInitInfo",
    "ROUTE_PREFIX",
    "UpdateAborted",
    "broadcast",
    "gather_to_sender",
    "join",
    "listen",
    "nbytes",
    "open_group",
    "plan_chunks",
    "received_chunks",
    "routed_chunks",
    "send_abort",
    "send_to",
]

DEFAULT_BUFFER_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_S = 120.0
# Byte alignment of each tensor inside a chunk: a received chunk is viewed as each tensor's dtype, which needs the
# offset to be a multiple of the element size; 64 covers every dtype and keeps cache lines whole.
ALIGN = 64
# The status trailer of every chunk: its first byte says whether the chunk carries data or aborts the update.
TRAILER = ALIGN
DATA, ABORT = 1, 2
STAGE_RECEIVE, STAGE_APPLY = "receive", "apply"
_STORE_PREFIX = "fsdp_vllm_sync/gloo"
ROUTE_PREFIX = "fsdp_vllm_sync/gloo/route"


class UpdateAborted(RuntimeError):
    """The trainer aborted this update part-way (its own stream failed); raised on the worker."""


def routed_abort(source: int, where: str) -> UpdateAborted:
    """A worker's error for a routed update that trainer rank `source` aborted (`aborted_by` reads it back)."""
    return UpdateAborted(f"trainer rank {source} aborted the update {where}")


_ABORTED_BY = re.compile(r"UpdateAborted: trainer rank (\d+) aborted the update")


def aborted_by(answer: str) -> int | None:
    """The trainer rank whose abort the server's error answer reports (`routed_abort`, as the worker's failure
    quotes it), or None: the server failed the update for another reason."""
    found = _ABORTED_BY.search(answer)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Chunk:
    """Tensors `[start, stop)` of an update, packed at `offsets` (bytes) into one buffer of `nbytes`."""

    start: int
    stop: int
    offsets: tuple[int, ...]
    nbytes: int


def plan_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[Chunk]:
    """Cut a stream of tensors (byte sizes, in order) into chunks of at most `buffer_bytes`.

    A tensor larger than the buffer travels alone in a chunk of its own size. Both sides call this on the announced
    metadata, so they agree on every chunk without exchanging it.
    """
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes={buffer_bytes}; must be > 0")
    chunks: list[Chunk] = []
    start, cursor, offsets = 0, 0, []
    for i, size in enumerate(sizes):
        offset = -(-cursor // ALIGN) * ALIGN
        if offsets and offset + size > buffer_bytes:
            chunks.append(Chunk(start, i, tuple(offsets), cursor))
            start, offset, offsets = i, 0, []
        offsets.append(offset)
        cursor = offset + size
    if offsets:
        chunks.append(Chunk(start, len(sizes), tuple(offsets), cursor))
    return chunks


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(kw_only=True)
class GlooWorkerInitInfo(WeightTransferInitInfo):
    """What each vLLM worker needs to join the trainer's group (sent by the trainer at the handshake)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    # The route group (routed updates): the trainer ranks that send (0: none; a trainer of an earlier version
    # of this package), and its size (those ranks and every worker).
    route_senders: int = 0
    route_world: int = 0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the tensors in stream order (vLLM dtype names: `"bfloat16"`, not `"torch.bfloat16"`); with
    `counts`, a sparse update: each tensor's number of changed elements, sent as patches; with `adapter`, a LoRA
    adapter (`{"id", "name", "config"}`: the tensors are its `lora_A`/`lora_B` in PEFT names), built in the worker's
    LoRA manager instead of written into the model, and staged there; with `publish` (no tensors), the name of the
    staged adapter version requests may name from now on (`compat.lora_patches`), `fresh` at a trainer's first
    publish (the versions served before it are another trainer's, and are retired)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    counts: list[int] | None = None
    adapter: dict[str, Any] | None = None
    publish: str | None = None
    fresh: bool = False
    # None: received and written now; "receive": received into host memory and kept (staged); "apply": write what was
    # staged (its names, dtypes and shapes are empty).
    stage: str | None = None
    # A routed update (`fsdp_sync.transfer.routes.RoutePlan.as_json`): each worker's cuts and their senders (a
    # sparse one's: each place's counts too); None: every tensor whole, broadcast from the sender.
    route: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stage not in (None, STAGE_RECEIVE, STAGE_APPLY):
            raise ValueError(f"stage={self.stage!r}; valid: None, {STAGE_RECEIVE!r}, {STAGE_APPLY!r}")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor; got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )
        if self.counts is not None and len(self.counts) != len(self.names):
            raise ValueError(f"counts must have one entry per tensor; got {len(self.counts)} for {len(self.names)}")

    def segment_sizes(self) -> list[int]:
        """A sparse update's segments in wire order, in bytes: per tensor its blocks, indices and values."""
        from fsdp_sync.patch_codec import segment_sizes

        assert self.counts is not None
        sizes: list[int] = []
        for dtype, shape, count in zip(self.dtypes(), self.shapes, self.counts, strict=True):
            sizes += segment_sizes(math.prod(shape), count, dtype.itemsize)
        return sizes

    def tensor_sizes(self) -> list[int]:
        """What travels, in bytes, in wire order: a sparse update's segments, else each tensor whole."""
        if self.counts is not None:
            return self.segment_sizes()
        return [nbytes(d, s) for d, s in zip(self.dtypes(), self.shapes)]

    def dtypes(self) -> list[torch.dtype]:
        dtypes: list[torch.dtype] = []
        for name, dtype_name in zip(self.names, self.dtype_names):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: unknown dtype name {dtype_name!r} (expected e.g. 'bfloat16')")
            dtypes.append(dtype)
        return dtypes


def local_address_towards(host: str) -> str:
    """The address of this host on the interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def listen(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store the sender hosts at `master_address:master_port`, for every rank to join.

    NOTE: the sender keeps the only reference to it, and its own group joins it as a client like the workers: so
    dropping that reference closes the listening port at once (measured: a TCPStore server stops when its last
    reference goes), whatever still holds the group (a failed round's traceback, an in-flight gloo work). A store
    handed to the group instead lived as long as the group, and a failed transfer kept the port until the garbage
    collector found it: the next handshake on the same port failed with EADDRINUSE (issue 27).

    Raises:
        RuntimeError: the port is taken (another process, or another trainer in this one); says which port.
    """
    try:
        return dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"the weight-transfer group port {master_port} on {master_address} is taken ({e}); another process, or "
            "another trainer of this process, listens there. Give this trainer a free vllm_group_port."
        ) from e


def join(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store the sender hosts (`listen`)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    prefix: str = _STORE_PREFIX,
) -> dist.ProcessGroupGloo:
    """A standalone gloo group over TCP, joined through the store the sender hosts (`listen`; `store`: a client of
    it already connected); touches no default process group. `prefix`: which group of that store (`ROUTE_PREFIX`:
    the route group)."""
    timeout = timedelta(seconds=timeout_s)
    store = store or join(master_address, master_port, world_size, timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # NOTE: gloo binds to the interface of the hostname by default, which may not be the one that reaches the peer;
    # bind to the address that routes to the store's host instead (loopback for a server on 127.0.0.1).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def broadcast(group: dist.ProcessGroupGloo, buffer: torch.Tensor) -> Any:
    """One chunk from rank 0 to every rank (asynchronous: returns the work to wait for)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def received_chunks(
    group: dist.ProcessGroupGloo, sizes: Sequence[int], buffer_bytes: int, aborted: str
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """The chunks of one update as they arrive (each buffer ends with its status trailer).

    Raises:
        UpdateAborted: the trainer marked a chunk `ABORT` (its stream failed); `aborted` says where.
    """
    for chunk in plan_chunks(sizes, buffer_bytes):
        buffer = torch.empty(chunk.nbytes + TRAILER, dtype=torch.uint8)
        broadcast(group, buffer).wait()
        if int(buffer[chunk.nbytes]) != DATA:
            raise UpdateAborted(f"the trainer aborted the update {aborted}")
        yield chunk, buffer


def send_to(group: dist.ProcessGroupGloo, buffer: torch.Tensor, rank: int, tag: int) -> Any:
    """One chunk to one rank of the route group (asynchronous: returns the work to wait for)."""
    return group.send([buffer], rank, tag)


def routed_chunks(
    group: dist.ProcessGroupGloo,
    sizes: Sequence[int],
    buffer_bytes: int,
    sources: Sequence[int],
    tag: int,
    aborted: str,
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """A worker's chunks of one routed update, each from the trainer rank that sends it (`sources`), as they arrive.

    Raises:
        UpdateAborted: a trainer rank marked the chunk `ABORT`; `aborted` says where.
        ValueError: the route names fewer senders than this worker has chunks (the two ends disagree).
    """
    chunks = plan_chunks(sizes, buffer_bytes)
    if len(chunks) != len(sources):
        raise ValueError(f"the route names {len(sources)} chunk sender(s) for this worker's {len(chunks)} chunks")
    for chunk, source in zip(chunks, sources):
        buffer = torch.empty(chunk.nbytes + TRAILER, dtype=torch.uint8)
        group.recv([buffer], source, tag).wait()
        if int(buffer[chunk.nbytes]) != DATA:
            raise routed_abort(source, aborted)
        yield chunk, buffer


def send_abort(
    group: dist.ProcessGroupGloo, buffer: torch.Tensor, chunk: Chunk, in_flight: Any, wait: Callable[[Any], None]
) -> None:
    """Tell the workers this update ends here: the chunk they expect next (`buffer`), marked `ABORT`, once the chunk
    `in_flight` (a work, or None) is through; every wait goes through `wait` (the sender's bound)."""
    buffer[chunk.nbytes] = ABORT
    if in_flight is not None:
        wait(in_flight)
    wait(broadcast(group, buffer))


def gather_to_sender(group: dist.ProcessGroupGloo, payload: bytes, wait: Callable[[Any], None]) -> list[bytes] | None:
    """Every rank's `payload` to rank 0, in rank order (None on the other ranks): the sizes all-gathered, then the
    payloads, padded to the longest, gathered. Every wait goes through `wait` (the caller's bound)."""
    world, rank = group.size(), group.rank()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    wait(group.allgather([sizes], [size]))
    longest = max(1, max(int(s) for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    options = dist.GatherOptions()
    options.rootRank = 0
    received = [[torch.empty(longest, dtype=torch.uint8) for _ in range(world)]] if rank == 0 else []
    wait(group.gather(received, [mine], options))
    if rank != 0:
        return None
    return [bytes(t[: int(n)].numpy()) for t, n in zip(received[0], sizes)]
