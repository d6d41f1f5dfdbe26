"""Persistent buffers, sent like parameters: what `save_pretrained` writes beside the weights, and vLLM loads.

Why: transformers keeps some checkpoint tensors as buffers rather than parameters, and vLLM loads them as weights:
DeepSeek-V3's router keeps `mlp.gate.e_score_correction_bias` as a persistent buffer (it is updated by a rule, not by
gradients), and vLLM's DeepSeek model loads it into a parameter. A sync of parameters alone leaves it stale (the
manifest check refused the plan before anything was written: "1 engine weight(s) the trainer does not send").

The rule is the checkpoint's own: a buffer is sent when it is persistent (in the module's `state_dict`, which is what
`save_pretrained` writes); non-persistent ones (rotary `inv_freq`, causal masks) are not checkpoint tensors. None of
FSDP1, FSDP2 or DDP shards buffers, so every rank holds each one whole: no collective is needed, and rank 0 reports
it wherever pieces must be disjoint (sparse syncs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from fsdp_sync.compat.manifest import TensorSpec

from ..distributed import Rounds, rank
from ..memory import MemoryMeter
from .base import Gatherer, HeldPieces, Piece, replica_piece, spec_of

__all__ = ["WithBuffers", "persistent_buffers"]


def persistent_buffers(model: nn.Module) -> list[str]:
    """Names of `model`'s persistent buffers (those in its `state_dict`), each once, in module order."""
    names: list[str] = []
    seen: set[int] = set()
    for path, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is None or leaf in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            names.append(f"{path}.{leaf}" if path else leaf)
    return names


class WithBuffers:
    """A gatherer's parameters, then the model's persistent buffers (read whole on every rank, no collective).

    Args:
        gatherer: the backend's gatherer of the parameters.
        model: the module the gatherer walks (so that buffer names carry the same wrapper segments as its
            parameter names, which the name mapping strips alike).
        names: the buffers to send (`persistent_buffers(model)`).
    """

    def __init__(self, gatherer: Gatherer, model: nn.Module, names: Iterable[str]) -> None:
        self.inner = gatherer
        self.model = model
        self.names = tuple(names)
        self.strategy = gatherer.strategy
        self.tensors_outlive_step = gatherer.tensors_outlive_step

    def _buffer(self, name: str) -> torch.Tensor:
        # NOTE: looked up at every read, not kept: a module may replace a buffer object (`self.bias = new`).
        return self.model.get_buffer(name).detach()

    def specs(self) -> dict[str, TensorSpec]:
        return {**self.inner.specs(), **{name: spec_of(self._buffer(name)) for name in self.names}}

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.inner.iter_full(meter, select, rounds)
        for name in self.names:
            if rounds is not None and (rounds.failed or rounds.stopped):
                return
            if select is None or name in select:
                yield name, self._buffer(name)

    def trainable(self) -> frozenset[str]:
        return self.inner.trainable()  # a buffer has no gradient: it changes only by rules the delta check sees

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = None if names is None else set(names)
        yield from self.inner.local_shards(None if wanted is None else wanted - set(self.names))
        for name in self.names:
            if wanted is None or name in wanted:
                yield name, self._buffer(name)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        wanted = list(names)
        own = set(self.names)
        yield from self.inner.local_pieces([n for n in wanted if n not in own])
        for name in wanted:
            if name in own:
                yield replica_piece(name, self._buffer(name), rank() == 0)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        own = set(self.names)
        params = [i for i, name in enumerate(names) if name not in own]
        inner = self.inner.held_pieces([names[i] for i in params])
        places = [(params[k], start, count) for k, start, count in inner.places]
        sizes = {i: self._buffer(name).numel() for i, name in enumerate(names) if name in own} if rank() == 0 else {}
        places += [(i, 0, n) for i, n in sizes.items() if n]
        buffers = [names[i] for i, n in sizes.items() if n]
        # NOTE: buffers are looked up at each read, as everywhere here (a module may replace a buffer object).
        return HeldPieces(tuple(places), lambda: [*inner.read(), *(self._buffer(name) for name in buffers)])
