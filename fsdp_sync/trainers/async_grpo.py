"""TRL's experimental `AsyncGRPOTrainer` under the mixin: where its sync is called, how pause, resume and versions map.

The seam, and why it has two halves:
- The trainer's `_sync_weight` is the mixin's (first in the MRO). TRL's callbacks call it at train begin and every
  `weight_sync_steps`, so TRL's control flow and callbacks are unchanged. It runs this library's sync: the plan and
  manifest check, the delta or sparse selection and the gathers (one FSDP unit at a time, every rank) and the bytes
  on the wire all happen while the server keeps generating; the server is paused only while its weights are written
  (`ServerWriter(pause_for_write=True)`: staged rounds on the gloo transport). Only after a sync that succeeded (and
  was verified, with `SyncConfig(verify=True)`) does `model_version` move and the rollout worker hear of it, as in
  TRL: at the sync's commit point (`publisher`), with the server's version. A sync that failed before that point
  raises `SyncError` on every rank with the server resumed and `model_version` where it was; one that failed after
  it is raised as landed, with all three moved together.
- A `WeightTransferProtocol` of this package is handed to the trainer (`weight_transfer=`): without one, TRL builds
  vLLM's NCCL client on rank 0 and opens its NCCL group at train begin (CUDA only, and a second transfer the server
  would hold), and probes the server for its adapter files path. Its `destroy` closes this package's transfer at
  the end of training.
`AsyncGRPOSeam` is everything the mixin does differently for this trainer (its constructor arguments, the merged
default, adapter syncs: the versions the server must keep and the rollout worker's requests naming each, the
writer's options, the version move); the mixin picks it once (`fsdp_sync.trainers.seam_for`) and
hands it typed callables, so nothing here reads a private attribute of the mixin, the writer or the transport.
A `WeightTransferProtocol` alone could not do this: TRL calls its `pause` before its own gathers and hands it
`_streaming_iter`, which calls `full_tensor()` per DTensor parameter and sends FSDP1's flat shards as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from fsdp_sync.compat.trl_api import log_sync_metrics

from ..errors import UnsupportedSetupError
from .base import TrainerSeam, WriterOptions

if TYPE_CHECKING:
    from ..config import SyncConfig
    from ..report import SyncReport

__all__ = ["AsyncGRPOSeam", "MixinWeightTransfer"]

logger = logging.getLogger(__name__)


class MixinWeightTransfer:
    """The `weight_transfer` an async trainer under the mixin holds (TRL's `WeightTransferProtocol`).

    TRL calls `init_weight_transfer` at train begin and `destroy` at the end of training (main process); `pause`,
    `send_weights` and `resume` belong to TRL's own sync (`_sync_weight_merged`), which the mixin replaces, and refuse.

    Args:
        trainer_name: the trainer's class name, for the refusals.
        close: closes this package's transfer to the server (its group port is free when it returns).
    """

    def __init__(self, trainer_name: str, close: Callable[[], None]) -> None:
        self._trainer_name = trainer_name
        self._close = close

    def init_weight_transfer(self) -> None:
        """Nothing here: the transfer is set up at the first sync, on every rank together (its handshake is part of
        the sync's failure model)."""
        logger.info("fsdp-vllm-sync: the weight transfer to the vLLM server is set up at the first sync")

    def _refuse(self, what: str) -> None:
        raise RuntimeError(
            f"{self._trainer_name} runs fsdp-vllm-sync's weight sync (FSDPVLLMSyncMixin); TRL's own "
            f"`{what}` is not used under it. Call `trainer._sync_weight()` (every rank) to push the weights."
        )

    def pause(self) -> None:
        self._refuse("pause")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._refuse("send_weights")

    def resume(self) -> None:
        self._refuse("resume")

    def destroy(self) -> None:
        """Close this package's transfer to the server (its group port is free when this returns)."""
        self._close()


class AsyncGRPOSeam(TrainerSeam):
    """TRL's `AsyncGRPOTrainer` (and subclasses) under the mixin.

    Args:
        trainer_name: the trainer's class name, for messages.
    """

    always_server = True

    def __init__(self, trainer_name: str) -> None:
        self.trainer_name = trainer_name

    def constructor_kwargs(
        self, bound: dict[str, Any], kwargs: dict[str, Any], close: Callable[[], None]
    ) -> dict[str, Any]:
        """The constructor gets this package's `weight_transfer`, and its config must name the server for every rank.

        Raises:
            UnsupportedSetupError: a `weight_transfer` of the user's, or no `args`.
        """
        if bound.get("weight_transfer") is not None:
            raise UnsupportedSetupError(
                f"{self.trainer_name} was given weight_transfer={bound['weight_transfer']!r}, but "
                "FSDPVLLMSyncMixin owns the weight sync: drop the weight_transfer argument, or the mixin."
            )
        if bound.get("args") is None:
            raise UnsupportedSetupError(
                f"{self.trainer_name} with FSDPVLLMSyncMixin needs args=AsyncGRPOConfig(vllm_server_base_url=...), "
                "so that every rank knows the vLLM server before the trainer is built."
            )
        return {**kwargs, "weight_transfer": MixinWeightTransfer(self.trainer_name, close)}

    def sync_config(self, config: SyncConfig) -> SyncConfig:
        """A LoRA model syncs merged unless adapter syncs are asked for (`SyncConfig(adapter=True)`).

        Why merged by default: adapter syncs need a LoRA server that keeps `max_staleness + 1` versions
        (`adapter_refusal`) and TRL's rollout worker made to name them (`serve_adapter`, a private field of TRL
        1.16's worker); merged weights reach every request of any server.
        """
        if config.adapter is None:
            logger.info(
                "fsdp-vllm-sync: TRL's AsyncGRPOTrainer syncs LoRA models merged (SyncConfig(adapter=False)); "
                "SyncConfig(adapter=True) pushes the adapter alone into a LoRA server"
            )
            return dataclasses.replace(config, adapter=False)
        return config

    def adapter_refusal(self, trainer: Any, kept_versions: Callable[[], int] | None) -> str | None:
        """The server must keep every version a rollout still in flight may name: the trainer accepts rollouts up to
        `max_staleness` versions old, so the last `max_staleness + 1` versions stay servable
        (`FSDP_VLLM_SYNC_ADAPTER_VERSIONS` on the server, within its `--max-cpu-loras`)."""
        if kept_versions is None:
            return None
        from fsdp_sync.compat.lora_patches import ADAPTER_VERSIONS_ENV

        needed = int(trainer.args.max_staleness) + 1
        kept = kept_versions()
        if kept < needed:
            return (
                f"the server keeps {kept} adapter version(s) servable, but max_staleness={trainer.args.max_staleness} "
                f"lets rollouts still in flight name the last {needed}: start the server with "
                f"{ADAPTER_VERSIONS_ENV}={needed} (and --max-cpu-loras {needed} or more), lower max_staleness, or "
                "use SyncConfig(adapter=False) (merged syncs)"
            )
        return None

    def serve_adapter(self, trainer: Any, prefix: str) -> bool:
        """The rollout worker (main process; it starts after the first sync) asks for `<prefix>-v<model_version>`:
        each request names the policy version it generates with, which is the adapter version the sync that made
        that version current pushed (both move once per sync that succeeded; `sync` checks it)."""
        from fsdp_sync.compat.trl_adapter import name_rollout_requests

        worker = getattr(trainer, "rollout_worker", None)
        if worker is not None:
            name_rollout_requests(worker, prefix)
        return True

    def writer_options(self, trainer: Any) -> WriterOptions:
        """The rollouts keep generating during training: the server is paused for the write alone, and its weight
        version names the policy version the rollouts will carry (the trainer's next `model_version`)."""
        return WriterOptions(pause_for_write=True, version_label=lambda: f"v{trainer.model_version + 1}")

    def publisher(self, trainer: Any) -> Callable[[int | None], None]:
        """At the commit point of every sync (`fsdp_sync.sync.frame`), on every rank that learns it landed:
        `trainer.model_version` moves, and the rollout worker hears of it (main process), so that the rollouts are
        labelled with the version the server now serves. On the writing rank this runs right after the server's
        version moved, before any other rank is asked; a rank that fails after it is told the sync landed."""

        def publish(adapter_version: int | None) -> None:
            version = trainer.model_version + 1
            if adapter_version is not None and adapter_version != version:
                # NOTE: the rollout worker names `<prefix>-v<model_version>`: the two must never part.
                raise RuntimeError(
                    f"adapter version {adapter_version} was published for policy version {version}: the rollout "
                    "worker would ask for another adapter than the current one"
                )
            trainer.model_version = version
            # NOTE: TRL builds its rollout worker on the main process only.
            worker = getattr(trainer, "rollout_worker", None)
            if worker is not None:
                worker.update_model_version(version)

        return publish

    def sync(
        self, trainer: Any, run: Callable[[], SyncReport | None], last_pause: Callable[[], tuple[float, float] | None]
    ) -> None:
        """One sync (what the trainer's `_sync_weight` does under the mixin); every rank calls it.

        The versions move inside `run`, at its commit point (`publisher`); this logs TRL's `perf/weight_sync_s` (the
        whole sync, as TRL measures it) and `weight_sync/server_paused_s` (how long the server's generation was
        paused: from the pause request to the resume answer) beside the sync's own figures.

        Raises:
            SyncError: on every rank when the sync failed on any: before its commit point with `model_version`,
                the rollout worker and the server's weight version unchanged (the server resumed); after it
                (`landed`) with all three moved together.
        """
        started = time.perf_counter()
        report = run()
        seconds = time.perf_counter() - started
        if report is None:  # the trainer's built-in sync ran (DeepSpeed ZeRO): no commit point of ours moved it
            logger.warning("fsdp-vllm-sync: the trainer's built-in sync ran (DeepSpeed ZeRO)")
            self.publisher(trainer)(None)
        metrics = {"perf/weight_sync_s": seconds}
        pause = last_pause()
        if pause is not None:
            metrics["weight_sync/server_paused_s"] = pause[0]
            metrics["weight_sync/server_write_s"] = pause[1]
        log_sync_metrics(trainer, metrics)
        logger.info(
            "fsdp-vllm-sync: policy version %d on the server (sync %.3f s%s)",
            trainer.model_version,
            seconds,
            f", generation paused {pause[0]:.3f} s" if pause is not None else "",
        )
