"""Routed dense updates: which part of each tensor every server worker receives, and which trainer rank sends it.

Why: a broadcast from one trainer rank sends every worker every full tensor; a tensor-parallel worker keeps its cut
of it (half, at TP2), and the one sender's link carries one copy per worker (issue 50: 102 MB out of rank 0 per
40.9 MB sync into TP2 or DP2). A routed update sends each worker its cut alone, and spreads the chunks over every
trainer rank: each rank holds every full tensor anyway while the gather hands it on (FSDP's all-gather of the unit),
so any rank can send any chunk.

The plan (`RoutePlan`), made by the trainer's sender and handed to every trainer rank (the control group) and every
worker (the update's announcement), so both ends follow the same one and nothing is computed twice:
- `cuts[place][i]`: what the workers at `place` (their index in a data-parallel replica) receive of tensor `i`:
  None (whole) or `[dim, start, size]`, the rows (or columns) their loader reads (`compat.tp_shards`'s rules).
- `sources[worker][k]`: the trainer rank that sends chunk `k` of `worker` (its chunks: `gloo_wire.plan_chunks` over
  its cut sizes), balanced by bytes in stream order.
A worker gives its loader the full-shaped tensor with its cut in place (`widen`): every layer keeps its own loader
(vLLM-CPU's repacking, quantized layers), and only the cut crosses the wire. The rest of that tensor is zeros the
loader never reads; `verify` compares every worker's weights bit for bit with the trainer's cut of them.

A sparse update routes too (`route_patches`): each worker receives only the changes inside its cut (`in_cut`),
still as flat indices into the full tensor, which vLLM's patch loader cuts as its weight loader does; `counts[place]`
says how many of each tensor's changes the workers at `place` receive. Its sender is the one rank that gathered the
patches (rank 0).

Pure: no group, no server; both ends import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fsdp_sync.patch_codec import segment_sizes

from .gloo_wire import plan_chunks

if TYPE_CHECKING:
    from fsdp_sync.compat.patch_api import EnginePatch

__all__ = [
    "Cut",
    "RoutePlan",
    "RoutedPatches",
    "cut_shape",
    "in_cut",
    "plan_cuts",
    "plan_route",
    "route_patches",
    "take",
    "widen",
]

# Chunks per sender a worker's stream is cut into at least (where the buffer allows): chunks as large as the buffer
# (64 MiB) would give a 41 MB model's TP2 worker one chunk, so one rank would send all of it; four per sender
# balance the bytes over the ranks within a chunk's size, and let the sends start while the gather goes on.
_CHUNKS_PER_SENDER = 4
# ... but no smaller than this: every chunk is one send (and one receive) with its own fixed cost.
_MIN_CHUNK = 64 * 2**10

# [dim, start, size]: the slice `narrow(dim, start, size)` of a full tensor; None: the whole tensor.
Cut = list[int] | None


def cut_shape(shape: Sequence[int], cut: Cut) -> tuple[int, ...]:
    """The shape of `cut` of a tensor of `shape`."""
    if cut is None:
        return tuple(shape)
    dim, _, size = cut
    return tuple(size if d == dim else n for d, n in enumerate(shape))


def take(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The part of a full tensor a worker receives (a view; not contiguous for a cut along columns)."""
    return tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2])


def widen(part: torch.Tensor, shape: Sequence[int], cut: Cut) -> torch.Tensor:
    """The full-shaped tensor a worker's loader is given: `part` at its cut, zeros elsewhere (never read by the
    loader, whose cut it is). NOTE: zeros, not uninitialised memory: a tied head and its embedding must arrive
    equal, as the worker checks."""
    if cut is None:
        return part.view(tuple(shape))
    full = part.new_zeros(tuple(shape))
    take(full, cut).copy_(part.view(cut_shape(shape, cut)))
    return full


def in_cut(indices: torch.Tensor, shape: Sequence[int], cut: Cut) -> torch.Tensor | None:
    """Which flat indices into a full tensor of `shape` lie inside `cut` (a bool mask; None: every one, no cut)."""
    if cut is None:
        return None
    dim, start, size = cut
    inner = math.prod(shape[dim + 1 :])
    along = torch.div(indices, inner, rounding_mode="floor").remainder_(shape[dim])
    return (along >= start) & (along < start + size)


def plan_cuts(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    parameter: Callable[[str], tuple[str, int, int]],
    rules: Sequence[Mapping[str, Any]],
) -> tuple[list[list[Cut]], list[str]]:
    """Each place's cut of each tensor, from the workers' rules (`compat.tp_shards.shard_rules`, one mapping per place,
    in place order) and where each checkpoint tensor lands (`parameter`: `EngineNaming.parameter`).

    A tensor goes whole where the rule says so, where there is no rule (a layer `tp_shards` does not know: never
    guessed), and where the rule's packing disagrees with the naming's. Returns the cuts and the names sent whole to
    a worker that shards them (for the log: nothing is cut that is not known).
    """
    cuts: list[list[Cut]] = [[] for _ in rules]
    whole: list[str] = []
    for name, shape in zip(names, shapes, strict=True):
        engine_name, index, parts = parameter(name)
        for place, place_rules in enumerate(rules):
            rule = place_rules.get(engine_name)
            cut: Cut = None
            if rule is not None and rule.get("dim") is not None:
                dim, pieces = int(rule["dim"]), rule["parts"]
                if len(pieces) == parts and dim < len(shape):
                    start, size = (int(v) for v in pieces[index])
                    if 0 <= start and start + size <= shape[dim] and size < shape[dim]:
                        cut = [dim, start, size]
            if cut is None and rule is not None and rule.get("dim") is not None and name not in whole:
                whole.append(name)
            cuts[place].append(cut)
    return cuts, whole


@dataclass(frozen=True)
class RoutePlan:
    """One routed update: its cuts and its senders (see the module docstring). JSON-able (`as_json`).

    Attributes:
        senders: trainer ranks taking part (transfer ranks `0 .. senders - 1`; worker `w` is `senders + w`).
        replica: workers per data-parallel replica (places); worker `w` is at place `w % replica`.
        workers: every worker of every replica.
        buffer_bytes: the chunk size both ends cut each worker's stream into.
        cuts: place -> tensor -> `Cut`.
        sources: worker -> chunk -> the trainer rank that sends it.
        tag: the update's tag on the route group (a send of an aborted update never matches a later one).
        counts: a sparse update's: place -> tensor -> the changes inside that place's cut (what its workers
            receive, as the three segments of `fsdp_sync.patch_codec`); None: a dense update.
    """

    senders: int
    replica: int
    workers: int
    buffer_bytes: int
    cuts: list[list[Cut]]
    sources: list[list[int]]
    tag: int = 0
    counts: list[list[int]] | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoutePlan:
        return cls(**data)

    def cuts_of(self, worker: int) -> list[Cut]:
        return self.cuts[worker % self.replica]

    def counts_of(self, worker: int) -> list[int]:
        """A sparse update's changes of each tensor that `worker` receives."""
        assert self.counts is not None, "a dense update's route has no counts"
        return self.counts[worker % self.replica]

    def sizes(self, worker: int, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[int]:
        """Bytes of each item `worker` receives, in stream order: each tensor's cut (dense); each tensor's three
        patch segments, of the changes inside its cut (sparse)."""
        if self.counts is None:
            return _cut_sizes(self.cuts_of(worker), shapes, dtypes)
        return _patch_sizes(self.counts_of(worker), shapes, dtypes)


def _cut_sizes(cuts: Sequence[Cut], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[int]:
    """Bytes of each tensor's cut, in stream order."""
    return [math.prod(cut_shape(s, c)) * d.itemsize for s, d, c in zip(shapes, dtypes, cuts, strict=True)]


def _patch_sizes(counts: Sequence[int], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[int]:
    """Bytes of each tensor's three patch segments, in stream order."""
    sizes: list[int] = []
    for count, shape, dtype in zip(counts, shapes, dtypes, strict=True):
        sizes += segment_sizes(math.prod(shape), count, dtype.itemsize)
    return sizes


# A routed sparse update: its plan, and per patch, per place, the three encoded segments of the changes in that
# place's cut (`route_patches`).
RoutedPatches = tuple[RoutePlan, list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]


def route_patches(
    patches: Sequence[EnginePatch],
    cuts: list[list[Cut]],
    *,
    senders: int,
    workers: int,
    buffer_bytes: int,
    tag: int = 0,
) -> RoutedPatches:
    """Each place's part of every patch (`cuts[place][i]`: its cut of patch `i`'s tensor), encoded, and the route
    of the sparse update that sends each worker its place's parts. A tensor a place holds whole is encoded once.

    NOTE: every chunk from rank 0: the patches are gathered to it (a sparse sync's bytes are a few percent of a dense
    one's), so the other ranks hold nothing to send; each worker still receives only its cut.

    Raises:
        ValueError: `workers` is not a multiple of the places in `cuts`, or there is no sender.
    """
    from fsdp_sync.patch_codec import encode_patch

    replica = _replicas(cuts, senders, workers)

    encoded: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    counts: list[list[int]] = [[] for _ in cuts]
    for i, patch in enumerate(patches):
        whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        parts = []
        for place, place_cuts in enumerate(cuts):
            inside = in_cut(patch.indices, patch.shape, place_cuts[i])
            if inside is None:
                whole = whole or encode_patch(patch)
                parts.append(whole)
                counts[place].append(patch.indices.numel())
            else:
                parts.append(encode_patch(patch._replace(indices=patch.indices[inside], values=patch.values[inside])))
                counts[place].append(int(inside.sum()))
        encoded.append(parts)
    shapes, dtypes = [p.shape for p in patches], [p.dtype for p in patches]
    plan = RoutePlan(senders, replica, workers, buffer_bytes, cuts, [], tag, counts)
    sources = [[0] * len(plan_chunks(plan.sizes(w, shapes, dtypes), buffer_bytes)) for w in range(workers)]
    return replace(plan, sources=sources), encoded


def _replicas(cuts: list[list[Cut]], senders: int, workers: int) -> int:
    """The workers per replica (places) of a route into `workers`.

    Raises:
        ValueError: `workers` is not a multiple of the places in `cuts`, or there is no sender.
    """
    replica = len(cuts)
    if senders < 1 or replica < 1 or workers % replica:
        raise ValueError(f"a route needs senders >= 1 and whole replicas: {senders} senders, {workers} workers, "
                         f"{replica} places")
    return replica


def plan_route(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    cuts: list[list[Cut]],
    *,
    senders: int,
    workers: int,
    buffer_bytes: int,
    tag: int = 0,
) -> RoutePlan:
    """The route of one update: every worker's chunks (`_CHUNKS_PER_SENDER` a sender at least, at most `buffer_bytes`
    each), each given to the trainer rank with the fewest bytes so far, in the order the stream completes them (so
    every rank sends from the start of the stream on).

    Raises:
        ValueError: `workers` is not a multiple of the places in `cuts`, or there is no sender.
    """
    replica = _replicas(cuts, senders, workers)
    largest = max(sum(_cut_sizes(place, shapes, dtypes)) for place in cuts)
    chunk = min(buffer_bytes, max(_MIN_CHUNK, -(-largest // (_CHUNKS_PER_SENDER * senders))))
    plan = RoutePlan(senders, replica, workers, chunk, cuts, [[] for _ in range(workers)], tag)
    # (the tensor that completes it, worker, bytes) for every chunk, in stream order.
    chunks = sorted(
        (chunk.stop, w, chunk.nbytes)
        for w in range(workers)
        for chunk in plan_chunks(plan.sizes(w, shapes, dtypes), plan.buffer_bytes)
    )
    load = [0] * senders
    for _, w, nbytes in chunks:
        rank = min(range(senders), key=lambda r: (load[r], r))
        load[rank] += nbytes
        plan.sources[w].append(rank)
    return plan
