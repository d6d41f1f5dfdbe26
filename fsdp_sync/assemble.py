"""Assemble the sync (or its stream alone) for one wrapped model: backend, gatherer, names, layout, PEFT merge.

Why its own module: the mixin, `iter_full_weights` and the benchmarks build the same pipeline from a model; this is
the one place that decides how.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_sync.compat.layout import Layout, layout_for
from fsdp_sync.compat.names import NameRules, canonical_name

from .backend import Backend, detect_backend, user_model
from .config import SyncConfig
from .errors import UnsupportedSetupError
from .gather import Gatherer, make_gatherer
from .peft_merge import PeftMerge
from .memory import MemoryMeter
from .sync.adapter import FALLBACK, AdapterSync, adapter_refusal
from .sync.delta import DeltaPolicy
from .sync.pipeline import WeightSync
from .sync.select import Everything, SelectionPolicy
from .sync.sparse import SparsePolicy
from .sync.stream import WeightStream
from .writers.base import EngineWriter, PatchWriter

__all__ = ["build_stream", "build_sync", "policy_for"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Parts:
    backend: Backend
    gatherer: Gatherer
    rules: NameRules
    layout: Layout
    merge: PeftMerge | None


class _Uncast:
    """Trainer names gathered in their own dtype, not cast to the engine's first: what the PEFT merge reads (it
    computes in the trainer's dtype and rounds once), and what the engine keeps wider than its dtype."""

    def __init__(self, merge: PeftMerge | None, rules: NameRules, wider: frozenset[str]) -> None:
        self.merge, self.rules, self.wider = merge, rules, wider

    def __call__(self, trainer_name: str) -> bool:
        if self.merge is not None and self.merge.reads(trainer_name):
            return True
        return bool(self.wider) and canonical_name(trainer_name, self.rules) in self.wider


def _parts(
    model: nn.Module,
    config: SyncConfig,
    dtype: torch.dtype | None,
    device: torch.device,
    backend: Backend | None,
    wider: frozenset[str] = frozenset(),
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
        keep_dtype=_Uncast(merge, rules, wider) if merge is not None or wider else None,
    )
    return _Parts(backend, gatherer, rules, layout_for(inner), merge)


def build_sync(
    model: nn.Module,
    writer: EngineWriter,
    config: SyncConfig,
    *,
    device: torch.device,
    backend: Backend | None = None,
) -> WeightSync | AdapterSync:
    """The sync pipeline for `model` (as the trainer holds it) into `writer`, configured by `config`: an adapter
    sync where `config.adapter` asks for one and the engine can serve the adapter, else merged (or plain) syncs.

    Args:
        device: where the model computes (CPU-offloaded FSDP shards are moved there before their gather).
        backend: the detected backend, when the caller has it already.

    Raises:
        UnsupportedSetupError: `SyncConfig(adapter=True)` and the adapter cannot be pushed as one (the reason and
            the fallback named); nothing was written.
    """
    if config.adapter is not False:
        adapter = _adapter_sync(model, writer, config, device, backend)
        if adapter is not None:
            return adapter
    # NOTE: read on every rank only where every rank has an engine (colocated): the gathers cast by it, so all ranks
    # must decide alike; a server's engine keeps its dtypes to itself (every floating tensor is cast).
    wider = frozenset(writer.manifest().wider) if config.check_manifest and writer.engine_per_rank else frozenset()
    parts = _parts(model, config, writer.engine_dtype, device, backend, wider)
    return WeightSync(
        parts.gatherer,
        writer,
        config,
        rules=parts.rules,
        layout=parts.layout,
        merge=parts.merge,
        backend=parts.backend.value,
        device=device,
        uncast=wider,
        policy=policy_for,
    )


def _adapter_sync(
    model: nn.Module, writer: EngineWriter, config: SyncConfig, device: torch.device, backend: Backend | None
) -> AdapterSync | None:
    """The adapter sync, decided once: None where merged syncs run (the reason logged for a PEFT model)."""
    backend = backend or detect_backend(model)
    inner = user_model(model)
    rules = NameRules.for_model(inner)
    if not rules.peft and config.adapter is None:
        return None
    gatherer = make_gatherer(model, backend, config, engine_dtype=None, compute_device=None)
    # NOTE: every option applies to the sync kind chosen, or that kind is not chosen (adapter=True refuses it in
    # `SyncConfig`): none is skipped silently.
    if config.sparse:
        refusal: str | None = "sparse=True sends the changed elements of merged weights"
    else:
        refusal = adapter_refusal(inner, gatherer, rules, writer)
    if refusal is None:
        logger.info("weight sync: adapter syncs (only lora_A/lora_B go, into the engine's LoRA manager)")
        return AdapterSync(inner, gatherer, writer, config, rules=rules, backend=backend.value)
    if config.adapter:
        raise UnsupportedSetupError(f"SyncConfig(adapter=True): {refusal}; {FALLBACK}. Nothing was written.")
    logger.info("weight sync: merged syncs, not adapter syncs: %s", refusal)
    return None


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


def policy_for(sync: WeightSync) -> SelectionPolicy:
    """The selection policy of `sync.config`'s mode, decided once (`WeightSync(policy=...)`); a new mode is one
    case here."""
    config, push, writer, uncast = sync.config, sync.push, sync.writer, sync.uncast

    def delta() -> DeltaPolicy:
        return DeltaPolicy(
            sync.gatherer,
            sync.coordinator,
            check=config.delta_check,
            merge_names=sync.merge.names if sync.merge is not None else frozenset(),
            versions=push.versions,
            unchanged=push.unchanged,
            device=sync.meter.device,
            engine_dtype=writer.engine_dtype,
        )

    match config.delta, config.sparse:
        case False, _:
            return Everything()
        case True, False:
            return delta()
        case True, True:
            return SparsePolicy(
                delta(),
                sync.gatherer,
                sync.coordinator,
                writer=writer if isinstance(writer, PatchWriter) else None,
                engine_dtype=writer.engine_dtype,
                engine_per_rank=writer.engine_per_rank,
                max_density=config.sparse_max_density,
                gather_patched=config.verify,
                peft=sync.merge is not None,
                uncast=uncast,
                unchanged=push.unchanged,
            )
        case other:
            raise ValueError(f"no selection policy for delta={other[0]!r}, sparse={other[1]!r}")
