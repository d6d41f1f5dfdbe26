"""Where a TRL trainer keeps its vLLM engine and its weight-sync entry point, across TRL versions.

Detected by feature, never by version:
- TRL >= 1.x GRPOTrainer / RLOOTrainer: `trainer.vllm_generation` (a `VLLMGeneration`) with `sync_weights()`, `mode`,
  `llm` (colocate), `vllm_client` (server, main process only), `enable_sleep_mode`, `_llm_weights_sleeping`.
- TRL 0.18-0.27 trainers and the experimental OnlineDPOTrainer of 1.16: `trainer._move_model_to_vllm()`, with
  `trainer.llm`, `trainer.vllm_client`, `trainer.vllm_mode` (or `args.vllm_mode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ServerAddress",
    "TRLSyncTarget",
    "defer_trl_weight_communicator",
    "find_sync_target",
    "log_sync_metrics",
    "mark_weights_awake",
    "server_address",
]

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


@dataclass(frozen=True)
class ServerAddress:
    """Where a server-mode trainer's vLLM server is, from the trainer's config (TRL's `vllm_server_*` fields).

    Attributes:
        base_url: e.g. `http://127.0.0.1:8000` (`vllm_server_base_url`, else host and port).
        startup_timeout_s: how long to wait for the server to come up (`vllm_server_timeout`).
        group_port: the port the trainer hosts the weight-transfer group on (`vllm_group_port`).
    """

    base_url: str
    startup_timeout_s: float
    group_port: int


def server_address(args: Any) -> ServerAddress | None:
    """The server a trainer config points at, or None unless it uses vLLM in server mode."""
    if args is None or not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "server":
        return None
    base_url = getattr(args, "vllm_server_base_url", None)
    if not base_url:
        base_url = f"http://{getattr(args, 'vllm_server_host', '0.0.0.0')}:{getattr(args, 'vllm_server_port', 8000)}"
    return ServerAddress(
        base_url=base_url.rstrip("/"),
        startup_timeout_s=float(getattr(args, "vllm_server_timeout", 240.0)),
        group_port=int(getattr(args, "vllm_group_port", 51216)),
    )


@contextlib.contextmanager
def defer_trl_weight_communicator() -> Iterator[None]:
    """While a trainer is being built, make TRL's `VLLMClient.init_communicator` a no-op.

    Why: TRL 1.x builds vLLM's NCCL weight-transfer group at construction, on the main process; on a machine
    without CUDA it raises `NotImplementedError`, and a server configured with another backend cannot use it. The
    mixin sets up the transport the server was started with at the first sync instead. Generation through TRL's
    client is unaffected (it needs no communicator).
    """
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:  # TRL without the 1.x client (older trainers build their own, at first use)
        yield
        return
    original = VLLMClient.__dict__.get("init_communicator")
    if original is None:
        yield
        return

    def deferred(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    VLLMClient.init_communicator = deferred  # type: ignore[method-assign]
    try:
        yield
    finally:
        VLLMClient.init_communicator = original  # type: ignore[method-assign]
