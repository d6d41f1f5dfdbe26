"""`"gloo"`: a CPU weight-transfer backend for vLLM's weight-update API (gloo collectives over TCP).

Why: vLLM 0.32's built-in backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) are CUDA-only, and its NCCL engine
on a CPU build reports success while moving nothing (vLLM #57022). This backend runs wherever torch's gloo does: a
CPU-only server, a test deployment, or a GPU server whose trainer has no NCCL path to it.

Protocol (both sides compute the same chunking from the metadata, so nothing but bytes crosses the group):
- init: the trainer's sender (rank 0) hosts a TCPStore at `master_address:master_port`; each vLLM worker joins a
  standalone gloo group of `1 + workers` ranks (worker ranks from `rank_offset`), independent of any default group.
- one update: `names`, `dtype_names`, `shapes` announced through `/update_weights`; the tensors, in that order, are
  packed into chunks of at most `buffer_bytes` (a larger tensor travels alone) and each chunk is one gloo broadcast
  from rank 0. The worker views each received chunk as the announced tensors and hands them to the model's
  `load_weights` inside vLLM's layer-wise reload (started in `start_weight_update`, finalised in
  `finish_weight_update`), which is what checkpoint-format weights need on repacked (CPU) and quantized layers.
- every chunk ends with a one-byte status (`_DATA` or `_ABORT`, padded to `_ALIGN`): when the trainer's own stream
  fails part-way (its gather, its name mapping, another rank), the sender broadcasts the chunk the workers expect
  next marked `_ABORT`, so they stop at once instead of waiting for the timeout; the worker then gives layers that
  received only part of their weights their previous ones back before finalising, so every engine weight holds
  either its previous or its new value, none undefined.
- a sparse update (`counts` given, `SyncConfig(sparse=True)`): each announced tensor travels as three segments,
  its changes per block of 2^16 elements (int32), the low 16 bits of each changed index (int16) and the new values
  (`fsdp_sync.sync.patches.encode_patch`, the codec of the trainer's own patch collectives), chunked and broadcast the
  same way; the workers decode them (`decode_patch`) and write them in
  place through vLLM's `load_checkpoint_weight_patches` (`fsdp_sync.compat.patch_api`), outside the layer-wise reload,
  which a sparse update never starts. On vLLM-CPU the linear weights must have been kept unpacked from the start:
  start the server with `FSDP_VLLM_SYNC_SPARSE=1` (the plugin then applies `keep_cpu_linear_weights`).
- a staged update (`stage="receive"`, then `stage="apply"`; the async trainer's writer, which pauses the server only
  for the write): the `/update_weights` request that announces an update returns at once, and a thread of each worker
  receives its chunks into host memory while the engine keeps generating; a later `/update_weights` with
  `stage="apply"` (sent with the server paused) writes every update received so far, in order (dense through the
  reload, then patches), and nothing reaches the engine before that: an update aborted or failed while staging
  leaves the engine unchanged. Costs the staged bytes in the server's host memory until they are written.
- memory: one chunk in flight on each side, plus what the layer-wise reload keeps until its layer is complete (staged
  updates: every chunk of the updates staged for one write).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from fsdp_sync.compat.patch_api import EnginePatch

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_TIMEOUT_S",
    "Chunk",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
    "GlooWorkerInitInfo",
    "plan_chunks",
]

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_S = 120.0
# Byte alignment of each tensor inside a chunk: a received chunk is viewed as each tensor's dtype, which needs the
# offset to be a multiple of the element size; 64 covers every dtype and keeps cache lines whole.
_ALIGN = 64
_STORE_PREFIX = "fsdp_vllm_sync/gloo"
# The status trailer of every chunk: its first byte says whether the chunk carries data or aborts the update.
_TRAILER = _ALIGN
_DATA, _ABORT = 1, 2
STAGE_RECEIVE, STAGE_APPLY = "receive", "apply"


class UpdateAborted(RuntimeError):
    """The trainer aborted this update part-way (its own stream failed); raised on the worker."""


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
        offset = -(-cursor // _ALIGN) * _ALIGN
        if offsets and offset + size > buffer_bytes:
            chunks.append(Chunk(start, i, tuple(offsets), cursor))
            start, offset, offsets = i, 0, []
        offsets.append(offset)
        cursor = offset + size
    if offsets:
        chunks.append(Chunk(start, len(sizes), tuple(offsets), cursor))
    return chunks


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def _local_address_towards(host: str) -> str:
    """The address of this host on the interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _listen(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
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


def _join(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store the sender hosts (`_listen`)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)


def _open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroupGloo:
    """A standalone gloo group over TCP, joined through the store the sender hosts (`_listen`; `store`: a client of
    it already connected); touches no default process group."""
    timeout = timedelta(seconds=timeout_s)
    store = store or _join(master_address, master_port, world_size, timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # NOTE: gloo binds to the interface of the hostname by default, which may not be the one that reaches the peer;
    # bind to the address that routes to the store's host instead (loopback for a server on 127.0.0.1).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(master_address))]
    return dist.ProcessGroupGloo(dist.PrefixStore(_STORE_PREFIX, store), rank, world_size, options)


def _broadcast(group: dist.ProcessGroupGloo, buffer: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def _received_chunks(
    group: dist.ProcessGroupGloo, sizes: Sequence[int], buffer_bytes: int, aborted: str
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """The chunks of one update as they arrive (each buffer ends with its status trailer).

    Raises:
        UpdateAborted: the trainer marked a chunk `_ABORT` (its stream failed); `aborted` says where.
    """
    for chunk in plan_chunks(sizes, buffer_bytes):
        buffer = torch.empty(chunk.nbytes + _TRAILER, dtype=torch.uint8)
        _broadcast(group, buffer).wait()
        if int(buffer[chunk.nbytes]) != _DATA:
            raise UpdateAborted(f"the trainer aborted the update {aborted}")
        yield chunk, buffer


@dataclass(kw_only=True)
class GlooWorkerInitInfo(WeightTransferInitInfo):
    """What each vLLM worker needs to join the trainer's group (sent by the trainer at the handshake)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the tensors in stream order (vLLM dtype names: `"bfloat16"`, not `"torch.bfloat16"`); with
    `counts`, a sparse update: each tensor's number of changed elements, sent as patches."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    counts: list[int] | None = None
    # None: received and written now; "receive": received into host memory and kept (staged); "apply": write what was
    # staged (its names, dtypes and shapes are empty).
    stage: str | None = None

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
        from fsdp_sync.sync.patches import index_blocks

        assert self.counts is not None
        sizes: list[int] = []
        for dtype, shape, count in zip(self.dtypes(), self.shapes, self.counts, strict=True):
            sizes += [4 * index_blocks(math.prod(shape)), 2 * count, dtype.itemsize * count]
        return sizes

    def dtypes(self) -> list[torch.dtype]:
        dtypes: list[torch.dtype] = []
        for name, dtype_name in zip(self.names, self.dtype_names):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: unknown dtype name {dtype_name!r} (expected e.g. 'bfloat16')")
            dtypes.append(dtype)
        return dtypes


class _DenseRound:
    """A dense update on the worker: the announced tensors, chunk by chunk, through vLLM's layer-wise reload (begun at
    its first chunk, finalised when the update finishes, and ended with every weight previous or new when it stops
    part-way)."""

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine
        self.reloading = False
        self.eager: dict[str, torch.Tensor] | None = None

    def _begin(self) -> None:
        from fsdp_sync.compat.reload_api import begin_reload, eager_reload_tensors
        from fsdp_sync.compat.vllm_patches import keep_moe_experts_processed_on_reload, load_gpt_oss_through_weight_loaders

        model = self.engine.model
        keep_moe_experts_processed_on_reload(model)
        load_gpt_oss_through_weight_loaders(model)
        begin_reload(model)
        self.reloading = True
        # What the reload writes in place as it arrives (biases), for a round that ends part-way.
        self.eager = eager_reload_tensors(model)

    def receive(self, info: GlooUpdateInfo, received: Iterable[tuple[Chunk, torch.Tensor]] | None = None) -> None:
        """Load one update's tensors inside the reload: its chunks as they arrive, or `received` (staged)."""
        if not self.reloading:
            self._begin()
        try:
            self.chunks(info, received)
        except Exception as e:
            # NOTE: the layer-wise reload has moved every layer to the meta device; without finalising, the engine
            # cannot generate at all. Layers that received part of their weights are given their previous ones back
            # first (vLLM would process them from what they have, leaving the rest uninitialised).
            from fsdp_sync.compat.reload_api import finalize_failed_reload
            from fsdp_sync.compat.vllm_patches import refresh_tied_cpu_gemms

            engine = self.engine
            previous, new = finalize_failed_reload(engine.model, engine.model_config, engine.device, self.eager)
            self.reloading = False
            refresh_tied_cpu_gemms(engine.model)
            logger.warning(
                "gloo weight transfer: update ended part-way; %d engine weight(s) hold their new values, %d their "
                "previous ones: %s",
                len(new),
                len(previous),
                ", ".join(previous),
            )
            what = "was aborted by the trainer" if isinstance(e, UpdateAborted) else "failed while receiving"
            raise RuntimeError(
                f"gloo weight transfer {what} ({type(e).__name__}: {e}). The engine was finalised and stays usable: "
                f"{len(new)} weight(s) hold the new values, {len(previous)} their previous ones, none is undefined; "
                "the next complete update replaces them all."
            ) from e

    def chunks(self, info: GlooUpdateInfo, received: Iterable[tuple[Chunk, torch.Tensor]] | None = None) -> None:
        """Receive the update's chunks (or take the staged ones, `received`) and hand their tensors to the model's
        loader (inside the reload)."""
        from fsdp_sync.compat.reload_api import partial_loads

        dtypes = info.dtypes()
        sizes = [_nbytes(d, s) for d, s in zip(dtypes, info.shapes)]
        if received is None:
            received = _received_chunks(self.engine.joined(), sizes, self.engine.buffer_bytes, "part-way")
        with partial_loads():
            for chunk, buffer in received:
                weights = []
                for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                    flat = buffer[offset : offset + sizes[i]].view(dtypes[i])
                    weights.append((info.names[i], flat.view(info.shapes[i])))
                # The views keep the chunk alive for as long as the layer-wise reload holds them.
                self.engine.model.load_weights(weights)
                del weights, buffer

    def finish(self) -> None:
        from fsdp_sync.compat.reload_api import end_reload
        from fsdp_sync.compat.vllm_patches import refresh_tied_cpu_gemms

        if self.reloading:
            engine = self.engine
            end_reload(engine.model, engine.model_config, engine.device)
            refresh_tied_cpu_gemms(engine.model)
            self.reloading = False


class _PatchRound:
    """A sparse update on the worker: received whole, then written in place (nothing is written before all of it
    arrived, so a transfer that fails part-way leaves the engine unchanged); never inside a reload."""

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine
        self.patcher: Any = None

    def receive(self, info: GlooUpdateInfo, received: Iterable[tuple[Chunk, torch.Tensor]] | None = None) -> None:
        """Receive one sparse update (or take the staged chunks, `received`) and write it in place."""
        from fsdp_sync.compat.patch_write import EnginePatcher
        from fsdp_sync.sync.patches import decode_patch

        model = self.engine.model
        started = time.perf_counter()
        sizes = info.segment_sizes()
        if received is None:
            received = _received_chunks(self.engine.joined(), sizes, self.engine.buffer_bytes, "(sparse)")
        segments: list[torch.Tensor] = []
        for chunk, buffer in received:
            segments += [buffer[o : o + sizes[i]] for i, o in zip(range(chunk.start, chunk.stop), chunk.offsets)]
        patches = [
            decode_patch(name, tuple(shape), dtype, *segments[3 * k : 3 * k + 3])
            for k, (name, dtype, shape) in enumerate(zip(info.names, info.dtypes(), info.shapes))
        ]
        received = time.perf_counter()
        if self.patcher is None or self.patcher.model is not model:
            self.patcher = EnginePatcher(model)
        self.patcher.apply(patches)
        logger.info(
            "gloo weight transfer: sparse update of %d tensors (%d changes, %d bytes): received in %.3f s, written in "
            "%.3f s",
            len(patches),
            sum(info.counts or ()),
            sum(sizes),
            received - started,
            time.perf_counter() - received,
        )


class _Staging:
    """Updates received ahead of their write (`stage="receive"`), written together on `stage="apply"`.

    NOTE: one receiving thread per engine, so the staged updates' broadcasts are received in the order the trainer
    sends them (two threads on one gloo group would interleave). The engine core is free meanwhile: the request that
    announced the update has returned, and the model keeps generating from its current weights.
    """

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fvs-gloo-stage")
        self.rounds: list[tuple[GlooUpdateInfo, Future]] = []

    def receive(self, info: GlooUpdateInfo) -> None:
        """Start receiving `info`'s chunks into host memory; returns at once."""
        group, buffer_bytes = self.engine.joined(), self.engine.buffer_bytes
        if info.counts is not None:
            sizes = info.segment_sizes()
        else:
            sizes = [_nbytes(d, s) for d, s in zip(info.dtypes(), info.shapes)]
        where = "(sparse, staged)" if info.counts is not None else "(staged)"
        self.rounds.append((info, self.pool.submit(lambda: list(_received_chunks(group, sizes, buffer_bytes, where)))))

    def apply(self, timeout_s: float) -> None:
        """Write every staged update, in the order received: dense ones through the reload (finalised before the
        next), then patches. Nothing is written unless every staged update arrived whole.

        Raises:
            RuntimeError: a staged update failed or was aborted while receiving (the engine is unchanged), or was
                not complete within `timeout_s`.
        """
        rounds, self.rounds = self.rounds, []
        received: list[tuple[GlooUpdateInfo, list[tuple[Chunk, torch.Tensor]]]] = []
        for info, future in rounds:
            try:
                received.append((info, future.result(timeout=timeout_s)))
            except Exception as e:
                raise RuntimeError(
                    f"gloo weight transfer: a staged update did not arrive whole ({type(e).__name__}: {e}); nothing "
                    "was written, the engine holds its previous weights."
                ) from e
        dense, patches = self.engine._dense, self.engine._patches
        for info, chunks in received:
            if info.counts is not None:
                patches.receive(info, chunks)
            elif info.names:
                dense.receive(info, chunks)
                dense.finish()

    def drop(self) -> None:
        """Forget updates staged and never applied (a round the trainer abandoned)."""
        if self.rounds:
            logger.warning("gloo weight transfer: %d staged update(s) were never applied; dropped", len(self.rounds))
        self.rounds = []


class GlooWeightTransferEngine(WeightTransferEngine[GlooWorkerInitInfo, GlooUpdateInfo]):
    """Worker side (inside the vLLM server): joins the trainer's group and receives each update in the round the
    update announces: dense (`_DenseRound`) or sparse (`_PatchRound`)."""

    init_info_cls = GlooWorkerInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._dense = _DenseRound(self)
        self._patches = _PatchRound(self)
        self._staging = _Staging(self)

    def _worker_rank(self) -> int:
        # Unique across data-parallel replicas, as vLLM's NCCL backend numbers its workers.
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank

    def joined(self) -> dist.ProcessGroupGloo:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized; call /init_weight_transfer_engine first.")
        return self.group

    def init_transfer_engine(self, init_info: GlooWorkerInitInfo) -> None:
        """Join the trainer's group; a new trainer (a restarted job) replaces the previous one."""
        self.shutdown()
        self.buffer_bytes = init_info.buffer_bytes
        self.timeout_s = init_info.timeout_s
        # A new trainer's rounds are received in order on a new thread (one left blocked on the previous group ends
        # with that group's error).
        self._staging = _Staging(self)
        rank = init_info.rank_offset + self._worker_rank()
        self.group = _open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )
        logger.info("gloo weight transfer: joined %s:%d as rank %d", init_info.master_address, init_info.master_port, rank)

    def start_weight_update(self) -> None:
        """Nothing yet: whether the update reloads (dense) or patches in place (sparse) comes with it."""
        self._dense.reloading = False

    def finish_weight_update(self) -> None:
        self._dense.finish()
        self._staging.drop()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one update and load it; or stage it (`stage="receive"`), or write the staged ones
        (`stage="apply"`).

        Overrides the base class, which ends with `torch.accelerator.synchronize()`: that raises on a CPU-only torch,
        and the loads here are synchronous copies from host memory.
        """
        info = self.parse_update_info(update_info)
        match info.stage:
            case None:
                (self._patches if info.counts is not None else self._dense).receive(info)
            case "receive":
                self._staging.receive(info)
            case "apply":
                self._staging.apply(self.timeout_s)
            case other:
                raise ValueError(f"stage={other!r}; valid: None, 'receive', 'apply'")

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """vLLM's receiving step of a dense update (the chunks, into a reload `update_weights` began)."""
        self._dense.chunks(update_info)

    def shutdown(self) -> None:
        # Dropping the group closes its sockets; gloo groups have no explicit destroy.
        self.group = None


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
    """

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    deadline: float | None = None


def _first_failure(futures: Sequence[Future], timeout_s: float, what: str) -> None:
    """Wait for all `futures`, raising the first exception as soon as any raises (not after the others)."""
    from concurrent.futures import FIRST_EXCEPTION, wait

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
        # The rendezvous store this sender hosts (`_listen`): only this attribute holds it.
        self._host: dist.TCPStore | None = None
        # `time.monotonic()` by which every wait of the current round ends (None: `timeout_s` alone).
        self.deadline: float | None = None
        # Chunks of data broadcast in the current round (0 until one is): whether the server can hold anything new.
        self.data_chunks = 0
        # Staged rounds (the writer sets it): each update is received into the server's host memory and written only
        # at `commit`, which the writer calls with the server paused.
        self.staged = False
        # A weight-update session is open on the server (staged rounds keep it open until `commit`).
        self._session = False

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
        )
        address, port, world, timeout_s = (
            init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_s
        )  # fmt: skip
        self._host = _listen(address, port, world, timeout_s)
        # NOTE: joined here, before the thread: a client that connects while its host is being closed would retry
        # for `timeout_s`; connected, its rendezvous fails as soon as the host goes.
        joined = _join(address, port, world, timeout_s)
        # The workers block in the rendezvous while answering the init request, so both run at once. The group is
        # opened on a daemon thread: if the server refuses the init, the error is raised at once, and closing the
        # store (`shutdown`) ends the abandoned rendezvous at once too.
        group: Future = Future()

        def open_sender() -> None:
            try:
                group.set_result(_open_group(address, port, 0, world, timeout_s, store=joined))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                group.set_exception(e)

        threading.Thread(target=open_sender, name="fvs-gloo-rendezvous", daemon=True).start()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.init_weight_transfer_engine, asdict(worker_info))
            wait_s = _left(init_info.timeout_s + 10, self.deadline)
            _first_failure([answer, group], wait_s, "the gloo weight-transfer handshake")
        finally:
            # Never join the request thread here: a server that does not answer is not waited for past the bound.
            pool.shutdown(wait=False)
        self.group = group.result()

    def bound(self, deadline: float | None) -> None:
        """End every wait of the next rounds by `deadline` (`time.monotonic()`; None: `timeout_s` alone)."""
        self.deadline = deadline

    def _wait(self, work: Any) -> None:
        """Wait for one broadcast, within the round's bound."""
        work.wait(timedelta(seconds=_left(self.timeout_s, self.deadline)))

    def send_weights(self) -> None:
        from fsdp_sync.compat.weight_transfer import source_metadata, source_tensors

        source = self.source
        assert source is not None
        meta = source_metadata(source)
        if not self.is_sender:
            for _ in source_tensors(source):
                pass
            return
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (trainer_init failed or was not called).")
        update = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.data_chunks = 0
        self._start(update)
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.update_weights, asdict(update))
            self._broadcast_stream(source_tensors(source), meta, answer)
            _first_failure([answer], _left(self.timeout_s, self.deadline), "the server's answer to /update_weights")
        finally:
            # Never join the request thread here: after a failed broadcast the server may still be waiting.
            pool.shutdown(wait=False)
        self._end()

    def _broadcast_stream(self, source: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta], answer: Future) -> None:
        """Pack the stream into chunks and broadcast each; one chunk on the wire while the next one fills. A failure
        of the stream itself aborts the update on the workers (the chunk they expect next, marked `_ABORT`)."""
        assert self.group is not None
        sizes = [_nbytes(m.dtype, m.shape) for m in meta]
        chunks = plan_chunks(sizes, self.buffer_bytes)
        stream = _checked(source, meta)
        in_flight: tuple[Any, torch.Tensor] | None = None
        for chunk in chunks:
            buffer = torch.empty(chunk.nbytes + _TRAILER, dtype=torch.uint8)
            try:
                for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                    _, tensor = next(stream)
                    buffer[offset : offset + sizes[i]].copy_(tensor.reshape(-1).view(torch.uint8))
                    del tensor
            except Exception:
                self._abort(buffer, chunk, in_flight)
                raise
            buffer[chunk.nbytes] = _DATA
            if answer.done():
                answer.result()  # the server gave up on this round: say why now, not after a broadcast timeout
            if in_flight is not None:
                self._wait(in_flight[0])
            in_flight = (_broadcast(self.group, buffer), buffer)
            if not self.staged:  # a staged chunk is kept in the server's host memory, not written
                self.data_chunks += 1
        if in_flight is not None:
            self._wait(in_flight[0])
        for name, _ in stream:  # the metadata was shorter than the stream
            raise ValueError(f"the weight stream yielded {name!r} after the {len(meta)} announced tensors")

    def send_patches(self, patches: Sequence[EnginePatch]) -> int:
        """One sparse update: announce the patched tensors and their counts, broadcast the encoded patches (the
        chunks of `plan_chunks` over each tensor's three segments). Returns the bytes broadcast."""
        from fsdp_sync.sync.patches import encode_patch

        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized (trainer_init failed or was not called).")
        update = GlooUpdateInfo(
            names=[p.name for p in patches],
            dtype_names=[str(p.dtype).removeprefix("torch.") for p in patches],
            shapes=[list(p.shape) for p in patches],
            counts=[p.indices.numel() for p in patches],
        )
        segments: list[ParamMeta] = []
        tensors: list[tuple[str, torch.Tensor]] = []
        for p in patches:
            for part, raw in zip(("blocks", "indices", "values"), encode_patch(p), strict=True):
                segments.append(ParamMeta(f"{p.name}:{part}", torch.uint8, (raw.numel(),)))
                tensors.append((segments[-1].name, raw))
        if [m.shape[0] for m in segments] != update.segment_sizes():
            raise AssertionError("sparse update: the encoded segments disagree with GlooUpdateInfo.segment_sizes")
        self.data_chunks = 0
        self._start(update)
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.update_weights, asdict(update))
            self._broadcast_stream(tensors, segments, answer)
            # NOTE: the workers write only once every chunk arrived; before that the engine is unchanged.
            self.data_chunks = 0 if self.staged else max(self.data_chunks, 1)
            _first_failure([answer], _left(self.timeout_s, self.deadline), "the server's answer to /update_weights")
        finally:
            pool.shutdown(wait=False)
        self._end()
        return sum(m.shape[0] for m in segments)

    def _start(self, update: GlooUpdateInfo) -> None:
        """Open the server's weight-update session (a staged round joins the one already open) and mark the update
        staged where this engine stages."""
        if self.staged:
            update.stage = STAGE_RECEIVE
            # Nothing staged has reached the engine yet.
            self.data_chunks = 0
        if not self._session:
            self.client.start_weight_update()
            self._session = True

    def _end(self) -> None:
        """Close the session after a round written now; a staged round's stays open until `commit`."""
        if self.staged:
            return
        self._session = False
        self.client.finish_weight_update()

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

    def _abort(self, buffer: torch.Tensor, chunk: Chunk, in_flight: tuple[Any, torch.Tensor] | None) -> None:
        """Tell the workers this update ends here: the chunk they expect next, marked `_ABORT` (best effort: a
        transport that already failed is left to its own error)."""
        assert self.group is not None
        buffer[chunk.nbytes] = _ABORT
        try:
            if in_flight is not None:
                self._wait(in_flight[0])
            self._wait(_broadcast(self.group, buffer))
        except Exception as e:  # noqa: BLE001 - the stream's own error is the one raised
            logger.warning("gloo weight transfer: could not tell the server to abort the update: %s", e)

    def shutdown(self) -> None:
        """Close the transfer now: the group port is free when this returns (this engine held the store's only
        reference), and the group's connections close once nothing else holds the group (gloo groups have no
        explicit close). The server's workers leave the group when the next handshake replaces it."""
        self.group = None
        self._host = None


def _checked(source: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
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
