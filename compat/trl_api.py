"""Where a TRL trainer keeps its vLLM engine and its weight-sync entry point, across TRL versions.

Detected by feature, never by version:
- TRL >= 1.x GRPOTrainer / RLOOTrainer: `trainer.vllm_generation` (a `VLLMGeneration`) with `sync_weights()`, `mode`,
  `llm` (colocate), `vllm_client` (server, main process only), `enable_sleep_mode`, `_llm_weights_sleeping`.
- TRL 0.18-0.27 trainers and the experimental OnlineDPOTrainer of 1.16: `trainer._move_model_to_vllm()`, with
  `trainer.llm`, `trainer.vllm_client`, `trainer.vllm_mode` (or `args.vllm_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TRLSyncTarget", "find_sync_target", "log_sync_metrics", "mark_weights_awake"]

VLLM_GENERATION = "vllm_generation"
MOVE_MODEL_TO_VLLM = "_move_model_to_vllm"


@dataclass(frozen=True)
class TRLSyncTarget:
    """The trainer's engine and sync entry point.

    Attributes:
        entry: `"vllm_generation"` (replace `trainer.vllm_generation.sync_weights`) or `"_move_model_to_vllm"`
            (override the trainer method).
        mode: `"colocate"` or `"server"`.
        llm: the in-process `vllm.LLM` (colocate), else None.
        client: TRL's `VLLMClient` (server mode, main process), else None.
        sleep_mode: whether the engine sleeps between generations (weights must be woken before a push).
        owner: the object that holds the entry point (`VLLMGeneration` or the trainer).
    """

    entry: str
    mode: str
    llm: Any
    client: Any
    sleep_mode: bool
    owner: Any


def _defines_move_model_to_vllm(cls: type) -> bool:
    # The mixin defines the method too (to override it); only a trainer class's own definition counts.
    return any(MOVE_MODEL_TO_VLLM in vars(c) for c in cls.__mro__ if not getattr(c, "_fvs_is_sync_mixin", False))


def find_sync_target(trainer: Any) -> TRLSyncTarget | None:
    """The trainer's vLLM sync target, or None when the trainer does not use vLLM."""
    if not getattr(getattr(trainer, "args", None), "use_vllm", getattr(trainer, "use_vllm", False)):
        return None
    generation = getattr(trainer, VLLM_GENERATION, None)
    if generation is not None and callable(getattr(generation, "sync_weights", None)):
        return TRLSyncTarget(
            entry=VLLM_GENERATION,
            mode=generation.mode,
            llm=getattr(generation, "llm", None),
            client=getattr(generation, "vllm_client", None),
            sleep_mode=bool(getattr(generation, "enable_sleep_mode", False)),
            owner=generation,
        )
    if _defines_move_model_to_vllm(type(trainer)):
        args = getattr(trainer, "args", None)
        mode = getattr(trainer, "vllm_mode", None) or getattr(args, "vllm_mode", "server")
        return TRLSyncTarget(
            entry=MOVE_MODEL_TO_VLLM,
            mode=mode,
            llm=getattr(trainer, "llm", None),
            client=getattr(trainer, "vllm_client", None),
            sleep_mode=bool(getattr(args, "vllm_enable_sleep_mode", False)),
            owner=trainer,
        )
    raise RuntimeError(
        f"{type(trainer).__name__} uses vLLM but has neither `vllm_generation.sync_weights` (TRL >= 1.0) nor "
        "`_move_model_to_vllm` (older TRL); this TRL version is not supported by FSDPVLLMSyncMixin."
    )


def mark_weights_awake(target: TRLSyncTarget) -> None:
    """Tell TRL the engine's weights are resident again (TRL re-pushes weights it believes are sleeping)."""
    if hasattr(target.owner, "_llm_weights_sleeping"):
        target.owner._llm_weights_sleeping = False


def log_sync_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    """Put sync figures where the trainer logs its own metrics (TensorBoard, W&B, ...).

    GRPO-family trainers (TRL 1.x) keep `_metrics[mode][key]` lists that are averaged into the next logged step;
    other trainers (e.g. OnlineDPOTrainer, whose `stats` lists would divide by zero when a key has no value in a
    logging interval) get their own log entry through `Trainer.log`.
    """
    buckets = getattr(trainer, "_metrics", None)
    if isinstance(buckets, dict) and "train" in buckets:
        mode = "train" if trainer.model.training else "eval"
        for key, value in metrics.items():
            buckets[mode][key].append(value)
    else:
        trainer.log(dict(metrics))
