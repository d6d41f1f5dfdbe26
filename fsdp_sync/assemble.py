"""Assemble the sync for one wrapped model and one writer: backend, gatherer, names, layout, PEFT merge, options.

Why its own module: the mixin, `iter_full_weights` and the benchmarks build the same pipeline from a model; this is
the one place that decides how.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_sync.compat.layout import layout_for
from fsdp_sync.compat.names import NameRules

from .backend import Backend, detect_backend, user_model
from .config import SyncConfig
from .gather import make_gatherer
from .peft_merge import PeftMerge
from .pipeline import WeightSync
from .writers.base import EngineWriter

__all__ = ["build_sync"]


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
    backend = backend or detect_backend(model)
    inner = user_model(model)
    rules = NameRules.for_model(inner)
    gatherer = make_gatherer(
        model,
        backend,
        config,
        engine_dtype=writer.engine_dtype,
        compute_device=device if device.type != "cpu" else None,
        merge_scopes=(PeftMerge.tuner_layer_type(),) if rules.peft else (),
    )
    return WeightSync(
        gatherer,
        writer,
        rules=rules,
        layout=layout_for(inner),
        merge=PeftMerge.for_model(inner, rules) if rules.peft else None,
        backend=backend.value,
        check_manifest=config.check_manifest,
        device=device,
        timeout_s=config.sync_timeout_s,
        check_finite=config.check_finite,
        verify=config.verify,
        delta=config.delta,
        delta_check=config.delta_check,
    )
