"""The gloo backend's worker side: runs inside each vLLM worker, joins the trainer's group and receives each update in
the round it announces.

- dense (`_DenseRound`): the chunks' tensors (a routed update: this worker's cut of each, from the trainer rank
  its route names, widened to the full shape for the loader: `fsdp_sync.transfer.routes`) handed to the model's `load_weights` inside vLLM's layer-wise reload
  (begun at the first chunk, finalised in `finish_weight_update`), which is what checkpoint-format weights need on
  repacked (CPU) and quantized layers. An update that ends part-way (the trainer's abort marker, a failed receive)
  gives layers that received only part of their weights their previous ones back before finalising, so every engine
  weight holds either its previous or its new value, none undefined.
- sparse (`_PatchRound`): received whole (a routed update: only the changes inside this worker's cut, still
  indexed into the full tensor), decoded (`fsdp_sync.patch_codec`) and written in place through vLLM's
  `load_checkpoint_weight_patches` (`fsdp_sync.compat.patch_api`), outside any reload. On vLLM-CPU the linear weights
  must have been kept unpacked from the start (`FSDP_VLLM_SYNC_SPARSE=1`, see `plugin.py`).
- staged (`_Staging`, `stage="receive"` then `stage="apply"`): received on a thread of the worker into host memory
  while the engine keeps generating; written, in order, only by the `apply` request (sent with the server paused).
  An update aborted or failed while staging leaves the engine unchanged. Costs the staged bytes until written.
- adapter (`_AdapterRound`): a LoRA adapter's tensors, built in the worker's LoRA manager, never written into the
  model.

Memory: one chunk in flight, plus what the layer-wise reload keeps until its layer is complete (staged updates:
every chunk of the updates staged for one write).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .gloo_wire import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    Chunk,
    ROUTE_PREFIX,
    GlooUpdateInfo,
    GlooWorkerInitInfo,
    UpdateAborted,
    open_group,
    received_chunks,
    routed_chunks,
)
from .routes import RoutePlan, widen

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["GlooWeightTransferEngine"]

logger = logging.getLogger(__name__)

Received = Iterable[tuple[Chunk, torch.Tensor]]


class _DenseRound:
    """A dense update on the worker: the announced tensors, chunk by chunk, through vLLM's layer-wise reload (begun at
    its first chunk, finalised when the update finishes, and ended with every weight previous or new when it stops
    part-way)."""

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine
        self.reloading = False
        self.eager: dict[str, torch.Tensor] | None = None
        # Engine parameter name -> the other names of the same tensor (a tied output head), read before the first
        # reload moves the layers to meta (where the tie is no longer visible).
        self.ties: dict[str, tuple[str, ...]] | None = None

    def _begin(self) -> None:
        from fsdp_sync.compat.reload_api import begin_reload, eager_reload_tensors
        from fsdp_sync.compat.vllm_patches import keep_moe_experts_processed_on_reload, load_gpt_oss_through_weight_loaders

        model = self.engine.model
        if self.ties is None:
            self.ties = _tied_names(model)
        keep_moe_experts_processed_on_reload(model)
        load_gpt_oss_through_weight_loaders(model)
        begin_reload(model)
        self.reloading = True
        # What the reload writes in place as it arrives (biases), for a round that ends part-way.
        self.eager = eager_reload_tensors(model)

    def receive(self, info: GlooUpdateInfo, received: Received | None = None) -> None:
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

    def chunks(self, info: GlooUpdateInfo, received: Received | None = None) -> None:
        """Receive the update's chunks (or take the staged ones, `received`) and hand their tensors to the model's
        loader (inside the reload)."""
        from fsdp_sync.compat.reload_api import partial_loads

        dtypes = info.dtypes()
        cuts, sizes = self.engine.cuts(info)
        if received is None:
            received = self.engine.receive(info, "part-way")
        received = iter(received)
        tied = _TiedValues(self.ties or {})
        with partial_loads():
            for chunk, buffer in received:
                weights = []
                try:
                    for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                        flat = buffer[offset : offset + sizes[i]].view(dtypes[i])
                        weights.append((info.names[i], widen(flat, info.shapes[i], cuts[i])))
                        tied.check(*weights[-1])
                    # The views keep the chunk alive for as long as the layer-wise reload holds them.
                    self.engine.model.load_weights(weights)
                except Exception:
                    # NOTE: the rest of the update is received and dropped before this is raised: its senders (every
                    # trainer rank, in a routed update) would otherwise wait on this worker until their timeout.
                    for _ in received:
                        pass
                    raise
                del weights, buffer

    def finish(self) -> None:
        from fsdp_sync.compat.reload_api import end_reload
        from fsdp_sync.compat.vllm_patches import refresh_tied_cpu_gemms

        if self.reloading:
            engine = self.engine
            end_reload(engine.model, engine.model_config, engine.device)
            refresh_tied_cpu_gemms(engine.model)
            self.reloading = False



def _tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter the model holds under several names (a head tied to the embedding) -> its other
    names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n: tuple(o for o in group if o != n) for group in names.values() if len(group) > 1 for n in group}


class _TiedValues:
    """One update's values for names the engine ties into one tensor: they must agree.

    Why: the engine holds one tensor for them (`lm_head.weight` is `model.embed_tokens.weight` with tied
    embeddings), and vLLM's loader writes each name it is given into it, the last one winning. A trainer whose head
    and embedding differ (its tie broken, e.g. by assigning the embedding a new parameter: vLLM's `ModuleSource` then
    sends both) had its embedding silently overwritten by its stale head: the update reported success, the engine's
    embedding kept its old values and generated from them. Equal values (a state-dict source sends both names) load
    as before.
    """

    def __init__(self, ties: dict[str, tuple[str, ...]]) -> None:
        self.ties = ties
        self.seen: dict[str, torch.Tensor] = {}

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raises ValueError naming both names when `tensor` differs from what this update sent for a tied name."""
        if name not in self.ties:
            return
        for other in self.ties[name]:
            if other in self.seen and not torch.equal(self.seen[other], tensor):
                raise ValueError(
                    f"the update sends different values for {other!r} and {name!r}, which this engine ties into one "
                    "tensor (tie_word_embeddings): the trainer's model no longer ties them. Tie them again in the "
                    "trainer (e.g. model.tie_weights()), or serve a checkpoint whose config unties them."
                )
        self.seen[name] = tensor


class _PatchRound:
    """A sparse update on the worker: received whole, then written in place (nothing is written before all of it
    arrived, so a transfer that fails part-way leaves the engine unchanged); never inside a reload."""

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine
        self.patcher: Any = None

    def receive(self, info: GlooUpdateInfo, received: Received | None = None) -> None:
        """Receive one sparse update (or take the staged chunks, `received`) and write it in place."""
        from fsdp_sync.compat.patch_write import EnginePatcher
        from fsdp_sync.patch_codec import decode_patch

        model = self.engine.model
        started = time.perf_counter()
        sizes = info.segment_sizes()
        if received is None:
            received = self.engine.receive(info, "(sparse)")
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
        chunks = self.engine.receive(info, "(sparse, staged)" if info.counts is not None else "(staged)")
        self.rounds.append((info, self.pool.submit(list, chunks)))

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


class _AdapterRound:
    """An adapter update on the worker: received whole, then built into a LoRA adapter and staged by name until the
    trainer publishes it (`compat.lora_patches`); the model's weights are never touched."""

    def __init__(self, engine: GlooWeightTransferEngine) -> None:
        self.engine = engine

    def receive(self, info: GlooUpdateInfo) -> None:
        from fsdp_sync.compat.lora_api import Adapter
        from fsdp_sync.compat.lora_patches import serve_in_memory_adapters, stash_adapter

        assert info.adapter is not None
        dtypes, sizes = info.dtypes(), info.tensor_sizes()
        tensors: dict[str, torch.Tensor] = {}
        for chunk, buffer in self.engine.receive(info, "(adapter)"):
            for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                tensors[info.names[i]] = buffer[offset : offset + sizes[i]].view(dtypes[i]).view(info.shapes[i])
        serve_in_memory_adapters()
        adapter = info.adapter
        stash_adapter(self.engine.model, Adapter(int(adapter["id"]), str(adapter["name"]), tensors, adapter["config"]))
        logger.info("gloo weight transfer: adapter %s (%d tensors) received", adapter["name"], len(tensors))


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
        # Every trainer rank and every worker (routed updates); None where the trainer opened none.
        self.route_group: dist.ProcessGroupGloo | None = None
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._dense = _DenseRound(self)
        self._patches = _PatchRound(self)
        self._staging = _Staging(self)
        self._adapter = _AdapterRound(self)

    def _worker_rank(self) -> int:
        # Unique across data-parallel replicas, as vLLM's NCCL backend numbers its workers.
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank

    def receive(self, info: GlooUpdateInfo, where: str) -> Received:
        """The chunks of `info` as they arrive on this worker's group (the wire's receive loop); `where` names the
        round in an abort.

        Raises:
            RuntimeError: the transfer was never initialized (no `/init_weight_transfer_engine`).
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized; call /init_weight_transfer_engine first.")
        if info.route is None:
            return received_chunks(self.group, info.tensor_sizes(), self.buffer_bytes, where)
        if self.route_group is None:
            raise RuntimeError("a routed weight update arrived, but this worker joined no route group (the trainer "
                               "runs another version of fsdp-vllm-sync: install the same one on both)")
        route = RoutePlan.from_json(info.route)
        worker = self._worker_rank()
        sizes = route.sizes(worker, info.shapes, info.dtypes())
        return routed_chunks(self.route_group, sizes, route.buffer_bytes, route.sources[worker], route.tag, where)

    def cuts(self, info: GlooUpdateInfo) -> tuple[list[list[int] | None], list[int]]:
        """This worker's cut of each tensor of a dense update (None: whole) and the bytes of each on the wire."""
        if info.route is None:
            return [None] * len(info.names), info.tensor_sizes()
        route = RoutePlan.from_json(info.route)
        worker = self._worker_rank()
        return route.cuts_of(worker), route.sizes(worker, info.shapes, info.dtypes())

    def init_transfer_engine(self, init_info: GlooWorkerInitInfo) -> None:
        """Join the trainer's group; a new trainer (a restarted job) replaces the previous one."""
        self.shutdown()
        self.buffer_bytes = init_info.buffer_bytes
        self.timeout_s = init_info.timeout_s
        # A new trainer's rounds are received in order on a new thread (one left blocked on the previous group ends
        # with that group's error).
        self._staging = _Staging(self)
        rank = init_info.rank_offset + self._worker_rank()
        address, port, timeout_s = init_info.master_address, init_info.master_port, init_info.timeout_s
        self.group = open_group(address, port, rank, init_info.world_size, timeout_s)
        if init_info.route_senders:
            route_rank = init_info.route_senders + self._worker_rank()
            self.route_group = open_group(
                address, port, route_rank, init_info.route_world, timeout_s, prefix=ROUTE_PREFIX
            )
        logger.info(
            "gloo weight transfer: joined %s:%d as rank %d (route group: %d trainer rank(s) send)",
            address, port, rank, init_info.route_senders,
        )  # fmt: skip

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
        if info.route is not None and info.counts is not None:
            # A routed sparse update: this worker receives, and writes, only the changes inside its cut.
            info = replace(info, counts=RoutePlan.from_json(info.route).counts_of(self._worker_rank()))
        if info.adapter is not None:
            self._adapter.receive(info)
            return
        if info.publish is not None:
            from fsdp_sync.compat.lora_patches import publish_adapter

            publish_adapter(info.publish, fresh=info.fresh)
            return
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
        self.route_group = None

