"""Assemble the sync (or its stream alone) for one wrapped model: backend, gatherer, names, layout, PEFT merge.

Why its own module: the mixin, `iter_full_weights` and the benchmarks build the same pipeline from a model; this is
the one place that decides how.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_sync.compat.layout import Layout, layout_for
from fsdp_sync.compat.names import NameRules

from .backend import Backend, detect_backend, user_model
from .config import SyncConfig
from .gather import Gatherer, make_gatherer
from .peft_merge import PeftMerge
from .memory import MemoryMeter
from .pipeline import WeightSync
from .stream import WeightStream
from .writers.base import EngineWriter

__all__ = ["build_stream", "build_sync"]


@dataclass(frozen=True)
class _Parts:
    backend: Backend
    gatherer: Gatherer
    rules: NameRules
    layout: Layout
    merge: PeftMerge | None


def _parts(
    model: nn.Module, config: SyncConfig, dtype: torch.dtype | None, device: torch.device, backend: Backend | None
) -> _Parts:
    backend = backend or detect_backend(model)
    inner = user_model(model)
    rules = NameRules.for_model(inner)
    merge = PeftMerge.for_model(inner, rules) if rules.peft else None
    gatherer = make_gatherer(
        model,
        backend,
        config,
        engine_dtype=dtype,
        compute_device=device if device.type != "cpu" else None,
        merge_scopes=(PeftMerge.tuner_layer_type(),) if merge is not None else (),
        keep_dtype=merge.reads if merge is not None else None,
    )
    return _Parts(backend, gatherer, rules, layout_for(inner), merge)


def build_sync(
    model: nn.Module,
    writer: EngineWriter,
    config: SyncConfig,
    *,
    device: torch.device,
    backend: Backend | None = None,
) -> WeightSync:
    """The sync pipeline for `model` (as the trainer holds it) into `writer`, configured by `config`.

    Args:
        device: where the model computes (CPU-offloaded FSDP shards are moved there before their gather).
        backend: the detected backend, when the caller has it already.
    """
    parts = _parts(model, config, writer.engine_dtype, device, backend)
    return WeightSync(
        parts.gatherer,
        writer,
        config,
        rules=parts.rules,
        layout=parts.layout,
        merge=parts.merge,
        backend=parts.backend.value,
        device=device,
    )


def build_stream(
    model: nn.Module, config: SyncConfig, *, dtype: torch.dtype | None, device: torch.device
) -> WeightStream:
    """The sync's data path for `model` with no engine behind it (`iter_full_weights`): tensors in `dtype`."""
    parts = _parts(model, config, dtype, device, None)
    return WeightStream(
        parts.gatherer,
        rules=parts.rules,
        layout=parts.layout,
        merge=parts.merge,
        dtype=dtype,
        meter=MemoryMeter(device),
    )
