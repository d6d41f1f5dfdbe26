"""Full weights the same way under FSDP1, FSDP2, DDP and a single process: the migration layer for user code.

Code around a sync (callbacks, reward models, evaluation, checkpoint export) often calls FSDP1's
`summon_full_params` or `state_dict_type`, which FSDP2 modules do not have. Two replacements that follow the backend:

- `iter_full_weights(model)`: `(checkpoint name, full tensor)` for every weight, one FSDP unit at a time (the sync's
  own gatherers, name mapping, PEFT merge and layout conversion), bounded in memory by the largest unit;
- `full_module(model)`: a context manager in which the module holds its full parameters, read-only, as
  `summon_full_params(writeback=False)` gives on FSDP1 (the whole model on every rank, for code that needs modules).

Both are collectives under FSDP: every rank must call them, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor

from .assemble import build_sync
from .backend import Backend, detect_backend, unwrap_outer, user_model
from .config import SyncConfig
from .distributed import rank
from .pipeline import WeightSync

__all__ = ["full_module", "full_weights_sync", "iter_full_weights"]

# Bounded by the largest unit: no next unit in flight (the sync's default overlaps one for speed).
_DEFAULT_CONFIG = SyncConfig(prefetch_bytes=0)


class _Iterating:
    """The `EngineWriter` side of an iteration: nothing is written; tensors are copied out where the gatherer would
    reuse their storage at the next unit (`retains_tensors`), so what the caller keeps stays valid."""

    kind = "iterator"
    pushes = True
    retains_tensors = True

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.engine_dtype = dtype

    def manifest(self) -> EngineManifest:
        raise AssertionError("no engine manifest: the iteration checks nothing against an engine")

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Nothing to announce."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("an iteration is consumed by its caller, not written")

    def finish(self) -> None:
        """Nothing to finish."""


def full_weights_sync(
    model: nn.Module, *, dtype: torch.dtype | None = None, config: SyncConfig | None = None
) -> WeightSync:
    """The sync pipeline that `iter_full_weights` runs, without an engine (its `meter` has the accounted peak)."""
    inner = user_model(model)
    device = next((p.device for p in inner.parameters() if p.device.type != "meta"), torch.device("cpu"))
    # Nothing is checked against an engine, and every weight is wanted every time.
    options = replace(config or _DEFAULT_CONFIG, check_manifest=False, delta=False, verify=False, check_finite=False)
    return build_sync(model, _Iterating(dtype), options, device=device)  # type: ignore[arg-type]


def iter_full_weights(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    rank0_only: bool = False,
    config: SyncConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `model` as `(checkpoint name, full tensor)`: the names a Hugging Face checkpoint (and vLLM's
    loader) use, PEFT adapters merged into their base weights, tied weights once, value heads left out (logged).

    Replaces `with FSDP.summon_full_params(model): ... model.named_parameters()` and `FSDP.state_dict_type(model,
    FULL_STATE_DICT)` in code that must also run under FSDP2 (and DDP, and one process). Every rank must iterate it
    to the end (the gathers are collectives). Peak extra memory: the largest FSDP unit (with the default `config`),
    plus what the caller keeps.

    Args:
        model: the model as the trainer holds it (`trainer.model_wrapped`, or an FSDP/DDP-wrapped module).
        dtype: cast floating tensors to this dtype (before the gather under FSDP: fewer bytes on the wire).
        rank0_only: yield on rank 0 only; the other ranks still take part in every gather and get nothing.
        config: gather strategy and prefetch (default: the flat strategy, no prefetch).
    """
    sync = full_weights_sync(model, dtype=dtype, config=config)
    stream = sync.stream()
    if rank0_only and rank() != 0:
        for _ in stream:
            pass
        return
    yield from stream


@contextlib.contextmanager
def full_module(model: nn.Module) -> Iterator[nn.Module]:
    """The user's module with full parameters for the duration of the block, read-only, on every rank.

    FSDP1: one `summon_full_params(root, recurse=True, writeback=False)` on the outermost FSDP instance (which is
    also the fix for TRL's child-first summon before the first forward); FSDP2: `unshard()` of every unit, then
    `reshard()`; DDP and a single process: the module itself. Holds the whole model on every rank: for weights by
    name, prefer `iter_full_weights` (one unit at a time).
    """
    outer = unwrap_outer(model)
    match detect_backend(model):
        case Backend.FSDP1:
            root = next(m for m in outer.modules() if isinstance(m, FSDP))
            with FSDP.summon_full_params(root, recurse=True, writeback=False):
                yield user_model(model)
        case Backend.FSDP2:
            units = [m for m in outer.modules() if isinstance(m, FSDPModule)]
            for unit in units:
                unit.unshard()
            try:
                yield user_model(model)
            finally:
                for unit in units:
                    unit.reshard()
        case _:
            yield user_model(model)
