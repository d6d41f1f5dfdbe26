"""Where things live in the vLLM engine, across versions, detected by feature in one place.

Why: the path from `vllm.LLM` to the worker and model moved between vLLM releases (`driver_worker.worker` in v1 with
in-process execution, `driver_worker` directly in older ones), the in-place `reload_weights(weights_iterator=...,
is_checkpoint_format=...)` appeared in vLLM 0.16 (before it the method took no arguments and re-read the checkpoint
from disk), and `reset_prefix_cache` grew keyword arguments. Writers ask this module and never probe the engine
themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["EngineHandle", "engine_handle", "reset_prefix_cache", "trainer_transfer_engine", "wake_up_weights"]


@dataclass(frozen=True)
class EngineHandle:
    """The parts of one in-process vLLM engine a colocated writer needs, resolved once.

    Attributes:
        llm: the `vllm.LLM`.
        worker: the worker object holding the model runner.
        model: the engine's `nn.Module`.
        push: callable taking an iterable of `(checkpoint_name, tensor)`; one call loads them all.
        push_kind: `"reload_weights"` (in place, layer-wise, handles repacked and quantized layers) or
            `"load_weights"` (the model's own loader; older engines).
        model_path: the model directory or hub id the engine was started from.
        dtype: the engine's compute dtype.
        restore_after_failed_push: a callable that puts an engine back into a usable state after a push that raised
            mid-way, or None where the engine needs none.
    """

    llm: Any
    worker: Any
    model: torch.nn.Module
    push: Callable[[Iterable[tuple[str, torch.Tensor]]], None]
    push_kind: str
    model_path: str
    dtype: torch.dtype
    restore_after_failed_push: Callable[[], None] | None


def _driver_worker(llm: Any) -> Any:
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        raise RuntimeError(
            "The vLLM engine runs its worker in another process, so weights cannot be written in place. Set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before the engine is created (TRL's colocate mode does this), or use "
            "server mode."
        )
    driver = executor.driver_worker
    # v1 wraps the real worker (WorkerWrapperBase.worker); older engines expose it directly.
    return getattr(driver, "worker", None) or driver


def _restore_fn(model: torch.nn.Module, model_config: Any) -> Callable[[], None] | None:
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
    except ImportError:  # engines without layer-wise reload do not move layers to meta during a load
        return None
    return lambda: finalize_layerwise_reload(model, model_config)


def _takes_weights_iterator(reload: Any) -> bool:
    """Whether the worker's `reload_weights` is the in-place, iterator-taking one (vLLM >= 0.16)."""
    if not callable(reload):
        return False
    import inspect

    try:
        parameters = inspect.signature(reload).parameters
    except (TypeError, ValueError):
        return False
    # vLLM's worker forwards `*args, **kwargs` to its model runner; look there when the worker's own is generic.
    if "weights_iterator" in parameters:
        return True
    runner = getattr(getattr(reload, "__self__", None), "model_runner", None)
    inner = getattr(runner, "reload_weights", None)
    if inner is None or inner is reload:
        return False
    try:
        return "weights_iterator" in inspect.signature(inner).parameters
    except (TypeError, ValueError):
        return False


def engine_handle(llm: Any) -> EngineHandle:
    """Resolve the worker, model, push entry point and metadata of an in-process `vllm.LLM`.

    Raises:
        RuntimeError: the engine's worker is out of process, or it has neither `reload_weights` nor a model with
            `load_weights`.
    """
    worker = _driver_worker(llm)
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model_config = llm.llm_engine.model_config
    if _takes_weights_iterator(getattr(worker, "reload_weights", None)):

        def push(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

        kind = "reload_weights"
        restore = _restore_fn(model, model_config)
    elif hasattr(model, "load_weights"):

        def push(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(weights)

        kind = "load_weights"
        restore = None
    else:
        raise RuntimeError(
            f"The vLLM worker {type(worker).__name__} has no reload_weights and its model {type(model).__name__} has "
            "no load_weights; this vLLM version is not supported by the colocated writer."
        )
    return EngineHandle(
        llm=llm,
        worker=worker,
        model=model,
        push=push,
        push_kind=kind,
        model_path=str(model_config.model),
        dtype=model_config.dtype,
        restore_after_failed_push=restore,
    )


def reset_prefix_cache(llm: Any) -> None:
    """Drop cached KV blocks computed with the old weights (all vLLM versions: the call takes no required args)."""
    llm.reset_prefix_cache()


def wake_up_weights(llm: Any) -> None:
    """Map the engine's weight memory back in before a push when sleep mode is on."""
    llm.wake_up(tags=["weights"])


def trainer_transfer_engine(backend: str) -> type:
    """The trainer-side weight-transfer engine class vLLM has registered for `backend` (e.g. `"nccl"`, `"gloo"`).

    Through vLLM's registry (`WeightTransferTrainerFactory`), so this package's own backends and vLLM's are reached
    the same way; the class's `init_info_cls` is the init info to build.

    Raises:
        ValueError: no trainer engine is registered under that name; lists the registered ones.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    # NOTE: `_registry` is private, but it is the only way to get a backend's class (and its init-info class)
    # without constructing an engine, which starts the rendezvous.
    registry = WeightTransferTrainerFactory._registry
    if backend not in registry:
        raise ValueError(
            f"vLLM has no trainer-side weight-transfer engine {backend!r}; registered: {sorted(registry)}"
        )
    return registry[backend]()
