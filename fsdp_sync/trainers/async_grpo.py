"""TRL's experimental `AsyncGRPOTrainer` under the mixin: where its sync is called, how pause, resume and versions map.

The seam, and why it has two halves:
- The trainer's `_sync_weight` is the mixin's (first in the MRO). TRL's callbacks call it at train begin and every
  `weight_sync_steps`, so TRL's control flow and callbacks are unchanged. It runs this library's sync: the plan and
  manifest check, the delta or sparse selection and the gathers (one FSDP unit at a time, every rank) and the bytes
  on the wire all happen while the server keeps generating; the server is paused only while its weights are written
  (`ServerWriter(pause_for_write=True)`: staged rounds on the gloo transport). Only after a sync that succeeded (and
  was verified, with `SyncConfig(verify=True)`) does `model_version` move and the rollout worker hear of it, as in
  TRL; a failed one raises `SyncError` on every rank with the server resumed and `model_version` where it was.
- A `WeightTransferProtocol` of this package is handed to the trainer (`weight_transfer=`): without one, TRL builds
  vLLM's NCCL client on rank 0 and opens its NCCL group at train begin (CUDA only, and a second transfer the server
  would hold), and probes the server for its adapter files path. Its `destroy` closes this package's transfer at
  the end of training.
A `WeightTransferProtocol` alone could not do this: TRL calls its `pause` before its own gathers and hands it
`_streaming_iter`, which calls `full_tensor()` per DTensor parameter and sends FSDP1's flat shards as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MixinWeightTransfer", "run_async_sync"]

logger = logging.getLogger(__name__)


class MixinWeightTransfer:
    """The `weight_transfer` an async trainer under the mixin holds (TRL's `WeightTransferProtocol`).

    TRL calls `init_weight_transfer` at train begin and `destroy` at the end of training (main process); `pause`,
    `send_weights` and `resume` belong to TRL's own sync (`_sync_weight_merged`), which the mixin replaces, and refuse.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def init_weight_transfer(self) -> None:
        """Nothing here: the transfer is set up at the first sync, on every rank together (its handshake is part of
        the sync's failure model)."""
        logger.info("fsdp-vllm-sync: the weight transfer to the vLLM server is set up at the first sync")

    def _refuse(self, what: str) -> None:
        raise RuntimeError(
            f"{type(self._trainer).__name__} runs fsdp-vllm-sync's weight sync (FSDPVLLMSyncMixin); TRL's own "
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
        sync = getattr(self._trainer, "_fvs_sync", None)
        close = getattr(getattr(sync, "writer", None), "close", None)
        if callable(close):
            close()


def run_async_sync(trainer: Any) -> None:
    """One async-trainer sync (what its `_sync_weight` does under the mixin); every rank calls it.

    Moves `trainer.model_version` (every rank) and the rollout worker's version (main process) only after the sync
    succeeded; logs TRL's `perf/weight_sync_s` (the whole sync, as TRL measures it) and `weight_sync/server_paused_s`
    (how long the server's generation was paused: from the pause request to the resume answer) beside the sync's own
    figures.

    Raises:
        SyncError: on every rank when the sync failed on any (`model_version` unchanged, the server resumed).
    """
    started = time.perf_counter()
    report = trainer.sync_weights_to_vllm()
    seconds = time.perf_counter() - started
    trainer.model_version += 1
    worker = getattr(trainer, "rollout_worker", None)
    if worker is not None:
        worker.update_model_version(trainer.model_version)
    metrics = {"perf/weight_sync_s": seconds}
    sync = getattr(trainer, "_fvs_sync", None)
    pause = getattr(getattr(sync, "writer", None), "last_pause", None)
    if pause is not None:
        metrics["weight_sync/server_paused_s"] = pause[0]
        metrics["weight_sync/server_write_s"] = pause[1]
    buckets = getattr(trainer, "_metrics", None)
    if isinstance(buckets, dict) and "train" in buckets:
        for key, value in metrics.items():
            buckets["train"][key].append(value)
    logger.info(
        "fsdp-vllm-sync: policy version %d on the server (sync %.3f s%s)",
        trainer.model_version,
        seconds,
        f", generation paused {pause[0]:.3f} s" if pause is not None else "",
    )
    if report is None:
        logger.warning("fsdp-vllm-sync: the trainer's built-in sync ran (DeepSpeed ZeRO)")
