"""Gatherers, one per backend and strategy; `make_gatherer` picks one, once per model."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..backend import Backend, UnsupportedBackendError, unwrap_outer
from ..config import SyncConfig
from .base import GatherFailed, Gatherer
from .buffers import WithBuffers, persistent_buffers
from .collectives import FlatOptions
from .fsdp1 import FSDP1FlatGatherer, FSDP1RootSummonGatherer, FSDP1UnitGatherer
from .fsdp2 import FSDP2FlatGatherer, FSDP2ParamGatherer, FSDP2UnitGatherer
from .plain import PlainGatherer

__all__ = [
    "FSDP1FlatGatherer",
    "FSDP1RootSummonGatherer",
    "FSDP1UnitGatherer",
    "FSDP2FlatGatherer",
    "FSDP2ParamGatherer",
    "FSDP2UnitGatherer",
    "FlatOptions",
    "GatherFailed",
    "Gatherer",
    "PlainGatherer",
    "WithBuffers",
    "make_gatherer",
]


def make_gatherer(
    model: nn.Module,
    backend: Backend,
    config: SyncConfig,
    *,
    engine_dtype: torch.dtype | None = None,
    compute_device: torch.device | None = None,
    merge_scopes: tuple[type, ...] = (),
    keep_dtype: Callable[[str], bool] | None = None,
) -> Gatherer:
    """The gatherer for `backend` and the configured strategy, followed by the model's persistent buffers where it
    has any (`WithBuffers`: checkpoint tensors that transformers keeps as buffers).

    Args:
        model: the model as the trainer holds it (outer DDP / compile wrappers are removed here).
        engine_dtype: the engine's dtype (FSDP2 per-unit checks its mixed-precision gather dtype against it).
        compute_device: where CPU-offloaded FSDP2 shards go before an all-gather (None: leave them).
        merge_scopes: module types whose nested units are gathered with their enclosing unit (PEFT tuner layers).
        keep_dtype: trainer names the flat strategies gather in their own dtype rather than cast to the engine's
            first (`FlatOptions.keep_dtype`).
    """
    inner = unwrap_outer(model)
    options = FlatOptions(
        engine_dtype=engine_dtype,
        keep_dtype=keep_dtype,
        compute_device=compute_device,
        prefetch_bytes=config.prefetch_bytes,
        timeout_s=config.sync_timeout_s,
    )
    gatherer = _parameter_gatherer(inner, backend, config, options, merge_scopes)
    buffers = persistent_buffers(inner)
    return WithBuffers(gatherer, inner, buffers) if buffers else gatherer


def _parameter_gatherer(
    inner: nn.Module, backend: Backend, config: SyncConfig, options: FlatOptions, merge_scopes: tuple[type, ...]
) -> Gatherer:
    """The gatherer of `backend`'s configured strategy; the per-unit and per-parameter ones take what of `options`
    applies to them."""
    strategy = config.fsdp1_strategy if backend == Backend.FSDP1 else config.fsdp2_strategy
    match backend, strategy:
        case Backend.FSDP1, "unit":
            return FSDP1UnitGatherer(inner, merge_scopes=merge_scopes)
        case Backend.FSDP1, "root":
            return FSDP1RootSummonGatherer(inner)
        case Backend.FSDP1, "flat":
            return FSDP1FlatGatherer(inner, options)
        case Backend.FSDP2, "unit":
            return FSDP2UnitGatherer(
                inner,
                engine_dtype=options.engine_dtype,
                compute_device=options.compute_device,
                merge_scopes=merge_scopes,
            )
        case Backend.FSDP2, "param":
            return FSDP2ParamGatherer(inner, compute_device=options.compute_device)
        case Backend.FSDP2, "flat":
            return FSDP2FlatGatherer(inner, options)
        case (Backend.DDP | Backend.PLAIN), _:
            return PlainGatherer(inner)
        case Backend.DEEPSPEED, _:
            raise UnsupportedBackendError(
                "DeepSpeed ZeRO models are not gathered by fsdp-vllm-sync; use the trainer's own sync "
                "(FSDPVLLMSyncMixin does so automatically)."
            )
        case _:
            raise ValueError(f"Unknown backend/strategy {backend!r}/{strategy!r}; see SyncConfig for valid ones")
