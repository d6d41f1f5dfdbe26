"""Where a TRL trainer keeps its vLLM engine and its weight-sync entry point, across TRL versions.

Detected by feature, never by version:
- TRL >= 0.28 GRPOTrainer / RLOOTrainer: `trainer.vllm_generation` (a `VLLMGeneration`, new in 0.28) with
  `sync_weights()`, `mode`, `llm` (colocate), `vllm_client` (server, main process only), `enable_sleep_mode`,
  `_llm_weights_sleeping`.
- TRL 0.18-0.27 trainers and the experimental OnlineDPOTrainer of 1.16: `trainer._move_model_to_vllm()`, with
  `trainer.llm`, `trainer.vllm_client`, `trainer.vllm_mode` (or `args.vllm_mode`). With transformers 5 and vLLM >= 0.28
  those TRL releases fail at import (pyproject.toml's `trl` floor); the path is run by OnlineDPOTrainer.
- TRL 1.16's experimental `AsyncGRPOTrainer` (`trl.experimental.async_grpo`): server mode only (no `use_vllm`, no
  `vllm_mode`: `args.vllm_server_base_url`); its callbacks call `trainer._sync_weight()` (at train begin and every
  `weight_sync_steps`), which pauses the server, streams through a `weight_transfer=` object (`WeightTransferProtocol`)
  and bumps `trainer.model_version`. Recognised by that method and that constructor argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ASYNC_SYNC_WEIGHT",
    "ServerAddress",
    "TRLSyncTarget",
    "defer_trl_weight_communicator",
    "find_sync_target",
    "is_async_trainer",
    "log_sync_metrics",
    "mark_weights_awake",
    "server_address",
    "server_mode_problem",
]

VLLM_GENERATION = "vllm_generation"
MOVE_MODEL_TO_VLLM = "_move_model_to_vllm"
ASYNC_SYNC_WEIGHT = "_sync_weight"
# The default port of TRL's weight-transfer group (`vllm_group_port`), for trainers whose config has none.
DEFAULT_GROUP_PORT = 51216


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


def _trainer_classes(cls: type, mixin: type | None) -> list[type]:
    """`cls`'s classes less `mixin` and its subclasses: the sync mixin defines the trainer's sync methods too (to
    override them), and a class built on it inherits those; only a trainer class's own definitions count."""
    return [c for c in cls.__mro__ if mixin is None or not issubclass(c, mixin)]


def _defines_move_model_to_vllm(cls: type, mixin: type | None = None) -> bool:
    return any(MOVE_MODEL_TO_VLLM in vars(c) for c in _trainer_classes(cls, mixin))


def is_async_trainer(cls: type, mixin: type | None = None) -> bool:
    """Whether `cls` is (a subclass of) TRL's async GRPO trainer: a trainer class of its own defines
    `_sync_weight` and its constructor takes `weight_transfer`.

    Args:
        mixin: the sync mixin `cls` is built on, if any (its classes are not the trainer's).
    """
    import inspect

    trainer_classes = _trainer_classes(cls, mixin)
    if not any(ASYNC_SYNC_WEIGHT in vars(c) for c in trainer_classes):
        return False
    for c in trainer_classes:
        if "__init__" in vars(c):
            try:
                return "weight_transfer" in inspect.signature(vars(c)["__init__"]).parameters
            except (TypeError, ValueError):
                return False
    return False


def find_sync_target(trainer: Any, mixin: type | None = None) -> TRLSyncTarget | None:
    """The trainer's vLLM sync target, or None when the trainer does not use vLLM (`mixin`: the sync mixin the
    trainer's class is built on, whose methods are not the trainer's)."""
    if is_async_trainer(type(trainer), mixin):
        return TRLSyncTarget(
            entry=ASYNC_SYNC_WEIGHT, mode="server", llm=None, client=None, sleep_mode=False, owner=trainer
        )
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
    if _defines_move_model_to_vllm(type(trainer), mixin):
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
        f"{type(trainer).__name__} uses vLLM but has neither `vllm_generation.sync_weights` (TRL >= 0.28) nor "
        "`_move_model_to_vllm` (older TRL); this TRL version is not supported by FSDPVLLMSyncMixin."
    )


def mark_weights_awake(target: TRLSyncTarget) -> None:
    """Tell TRL the engine's weights are resident again (TRL re-pushes weights it believes are sleeping)."""
    if hasattr(target.owner, "_llm_weights_sleeping"):
        target.owner._llm_weights_sleeping = False


def log_sync_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    """Put sync figures where the trainer logs its own metrics (TensorBoard, W&B, ...).

    GRPO-family trainers (GRPOTrainer, RLOOTrainer) keep `_metrics[mode][key]` lists that are averaged into the next
    logged step; other trainers (e.g. OnlineDPOTrainer, whose `stats` lists would divide by zero when a key has no
    value in a logging interval) get their own log entry through `Trainer.log`.
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


def server_address(args: Any, *, always_server: bool = False, group_port: int | None = None) -> ServerAddress | None:
    """The server a trainer config points at, or None unless it uses vLLM in server mode.

    Args:
        args: the trainer's config.
        always_server: the trainer has no colocated mode (TRL's async trainer: no `use_vllm`, no `vllm_mode`).
        group_port: the weight-transfer group's port when the config names none (`SyncConfig.group_port`).
    """
    if args is None:
        return None
    if not always_server and (not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "server"):
        return None
    base_url = getattr(args, "vllm_server_base_url", None)
    if not base_url:
        base_url = f"http://{getattr(args, 'vllm_server_host', '0.0.0.0')}:{getattr(args, 'vllm_server_port', 8000)}"
    return ServerAddress(
        base_url=base_url.rstrip("/"),
        startup_timeout_s=float(getattr(args, "vllm_server_timeout", 240.0)),
        group_port=int(group_port or getattr(args, "vllm_group_port", DEFAULT_GROUP_PORT)),
    )


def server_mode_problem() -> str | None:
    """Why this TRL's server mode cannot take this package's weight sync, or None when it can.

    TRL 1.11 moved its `VLLMClient` to vLLM's own server (`vllm serve`: the OpenAI routes, and vLLM's weight-transfer
    API, which this package's server writer drives); up to 1.10 it spoke to TRL's own `trl vllm-serve` routes
    (`/generate/`, `/init_communicator/`, `/update_named_param/`), which have no weight-transfer API (measured with
    TRL 0.29: generation requests to vLLM's server answered 404). The 1.11 client is recognised by its
    `weight_update()` (the bracket of one weight update on vLLM's server).
    """
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:
        return "this TRL has no trl.generation.vllm_client (TRL 0.28+)"
    if callable(getattr(VLLMClient, "weight_update", None)):
        return None
    import trl

    return (
        f"TRL {trl.__version__}'s VLLMClient speaks to `trl vllm-serve`'s own routes (/generate/, "
        "/update_named_param/), not to vLLM's server, whose weight-transfer API fsdp-vllm-sync sends weights "
        "through. TRL 1.11 and later talk to vLLM's server: upgrade TRL, or use vllm_mode='colocate'."
    )


@contextlib.contextmanager
def defer_trl_weight_communicator() -> Iterator[None]:
    """While a trainer is being built, make TRL's `VLLMClient.init_communicator` a no-op.

    Why: TRL >= 0.28 builds vLLM's NCCL weight-transfer group at construction, on the main process; on a machine
    without CUDA it raises `NotImplementedError`, and a server configured with another backend cannot use it. The
    mixin sets up the transport the server was started with at the first sync instead. Generation through TRL's
    client is unaffected (it needs no communicator).

    NOTE: TRL 0.28-1.9 call `init_communicator(device=torch.cuda.current_device())` (1.10+ pass
    `accelerator.device`): the argument is evaluated before the deferred call and raises on a trainer without CUDA
    ("Torch not compiled with CUDA enabled"; seen with TRL 0.29). On such a trainer, while it is built,
    `torch.cuda.current_device()` answers 0 instead of raising; the deferred call ignores it, and TRL 0.29.0 has no
    other call of it in its trainers' construction.
    """
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:  # TRL without the 0.28+ client (older trainers build their own, at first use)
        yield
        return
    original = VLLMClient.__dict__.get("init_communicator")
    if original is None:
        yield
        return

    def deferred(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    import torch

    current_device = torch.cuda.current_device
    no_cuda = not torch.cuda.is_available()
    VLLMClient.init_communicator = deferred  # type: ignore[method-assign]
    if no_cuda:
        torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        VLLMClient.init_communicator = original  # type: ignore[method-assign]
        torch.cuda.current_device = current_device  # type: ignore[assignment]
