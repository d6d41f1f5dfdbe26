"""Gatherer for modules whose parameters are already full on every rank: single process, DDP, DataParallel."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from fsdp_sync.compat.manifest import TensorSpec

from ..distributed import Rounds
from ..faults import fault_point
from ..distributed import rank
from ..memory import MemoryMeter
from .base import HeldPieces, Piece, replica_held, replica_piece, spec_of

__all__ = ["PlainGatherer"]


class PlainGatherer:
    """Yield parameters as they are (detached); nothing is gathered and nothing extra is allocated.

    Tied parameters are yielded once, under their first name (`named_parameters` de-duplicates them).
    """

    strategy = "plain"
    tensors_outlive_step = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def specs(self) -> dict[str, TensorSpec]:
        return {name: spec_of(p) for name, p in self.model.named_parameters()}

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # No collective here: nothing to agree on between ranks (the sync's final agreement covers the push).
        if rounds is not None:
            rounds.attempt("gather", lambda: fault_point("gather.prepare", unit=0, units=1))
        for name, param in self.model.named_parameters():
            if rounds is not None and rounds.failed:
                return
            if select is None or name in select:
                yield name, param.detach()

    def trainable(self) -> frozenset[str]:
        return frozenset(name for name, p in self.model.named_parameters() if p.requires_grad)

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iter_full(MemoryMeter(torch.device("cpu")), None if names is None else frozenset(names))

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        # Every rank holds the whole tensor: rank 0 reports it, the others an empty piece (pieces are disjoint).
        params = dict(self.model.named_parameters())
        for name in names:
            yield replica_piece(name, params[name], rank() == 0)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        # NOTE: the parameter objects are kept, as the optimizer keeps them; their data is read at each sync.
        params = dict(self.model.named_parameters())
        return replica_held([params[name] for name in names], rank() == 0)
