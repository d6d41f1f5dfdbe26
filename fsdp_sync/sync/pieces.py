"""Full tensors from every rank's disjoint pieces: an adapter sync's exchange (`adapter.pieces`), with what it needs
per tensor worked out once per plan and reused by every later sync.

Why worked out once: the pieces a rank holds, their places in the full tensors and the full tensors' shapes are
fixed by the FSDP sharding; placing each piece with its own copy, in a Python loop, repeated work that does not
change between syncs. With many small tensors (an adapter on every linear layer: 392 tensors of a few KB) that
per-tensor work was the sync: an adapter's payload moves in microseconds. So a sync costs:
- this rank's pieces read (`HeldPieces.read`, from the gatherer: views of the shards, made once) and packed in one
  copy (`torch._utils._flatten_dense_tensors`, one concatenation);
- the exchange: the layout (two small all-gathers: a layout that changed is seen on every rank alike, and the
  collectives the failure model counts stay the same) and the values (one all-gather);
- one concatenation that puts the gathered runs in their order (runs that follow each other in both places merged:
  at world size 1, or wherever the pieces already lie in order, the gathered buffer is the result and nothing is
  copied), and the full tensors as views of it in one call (`_unflatten_dense_tensors`).

NOTE: `torch._utils._flatten_dense_tensors` / `_unflatten_dense_tensors` (torch's C++ flatten and unflatten, used by
DDP's and Apex's bucketing since torch 1.0, still in 2.13) do in one call what a Python loop did per tensor (a
reshape and a `view` each: measured, most of a 392-tensor adapter sync's time on one CPU rank).

NOTE: the route is kept per run (a piece, or merged pieces), not per element: an element index would cost 8 bytes
an element (four times a bf16 adapter) and its own pass over them; measured on one H100, a route of element indices
made a 7B all-linear adapter sync (80.74 MB) slower than the per-piece copies it replaced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..distributed import collective
from ..gather.base import HeldPieces

__all__ = ["Packed", "PieceExchange"]

# This rank's values of one sync, packed: one flat tensor per dtype.
Packed = dict[torch.dtype, torch.Tensor]


@dataclass(frozen=True)
class _Route:
    """For one dtype and one layout of every rank's pieces: the gathered buffer cut into `segments` (its runs and
    the gaps between them), and `order`, the segments that make the dtype's flat buffer, in its order (None: the
    gathered buffer's first elements are that buffer already)."""

    places: torch.Tensor  # every rank's (index, start, count) rows, as gathered (padded with -1)
    lengths: tuple[int, ...]  # every rank's number of values
    segments: tuple[int, ...]
    order: tuple[int, ...] | None


@dataclass(frozen=True)
class _Group:
    """The tensors of one dtype: their names and full shapes (meta tensors, for `_unflatten_dense_tensors`), their
    numels, this rank's held pieces of them, and those pieces' places as the exchange sends them."""

    names: tuple[str, ...]
    shapes: tuple[torch.Tensor, ...]
    numels: tuple[int, ...]
    held: HeldPieces
    places: torch.Tensor


class PieceExchange:
    """Exchanges every rank's pieces of `names` into full tensors; one per plan, called once per sync.

    Every rank must make it with the same `names`, `shapes` and `dtypes` (metadata every rank has), and call it
    inside `Coordinator.run` on the sync's own group (`adapter.pieces`): three all-gathers per dtype (sizes, the
    pieces' places, their values), whatever the number of tensors.

    Args:
        names, shapes, dtypes: the full tensors.
        held: this rank's pieces of a list of names (`Gatherer.held_pieces`), asked once per dtype.

    Attributes:
        order: the names in the order `__call__` returns their full tensors (by dtype, then as given).
    """

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[torch.dtype],
        held: Callable[[Sequence[str]], HeldPieces],
    ) -> None:
        self._groups: dict[torch.dtype, _Group] = {}
        for dtype in sorted(set(dtypes), key=str):
            members = [i for i, d in enumerate(dtypes) if d == dtype]
            group_names = tuple(names[i] for i in members)
            pieces = held(group_names)
            self._groups[dtype] = _Group(
                group_names,
                tuple(torch.empty(shapes[i], dtype=dtype, device="meta") for i in members),
                tuple(math.prod(shapes[i]) for i in members),
                pieces,
                torch.tensor(pieces.places, dtype=torch.int64).reshape(-1, 3),
            )
        self.order = tuple(name for group in self._groups.values() for name in group.names)
        self._counts = {dtype: sum(count for _, _, count in g.held.places) for dtype, g in self._groups.items()}
        self._sizes = {dtype: sum(g.numels) for dtype, g in self._groups.items()}
        self._routes: dict[torch.dtype, _Route] = {}

    def pack(self) -> Packed:
        """This sync's values of this rank's pieces, one flat tensor per dtype (one copy; no collective).

        Raises:
            RuntimeError: a held tensor is no longer the size it was when planned (named).
        """
        packed: Packed = {}
        with torch.no_grad():
            for dtype, group in self._groups.items():
                tensors = group.held.read()
                if not tensors:
                    packed[dtype] = torch.empty(0, dtype=dtype)
                    continue
                # NOTE: always a copy: one tensor is flattened as a view of itself, and the full tensors (views of
                # these values at world size 1) are kept by the engine's writer past the next optimizer step.
                values = _flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
                if values.numel() != self._counts[dtype]:
                    raise RuntimeError(f"this rank's pieces changed size since the plan: {few(_resized(group, tensors))}")
                packed[dtype] = values if values.dtype == dtype else values.to(dtype)
        return packed

    def named_values(self, packed: Packed) -> list[tuple[str, torch.Tensor]]:
        """`packed` cut back into (name, this rank's piece of it), for messages that name tensors (a slow path)."""
        out = []
        for dtype, group in self._groups.items():
            at = 0
            for i, _, count in group.held.places:
                out.append((group.names[i], packed[dtype][at : at + count]))
                at += count
        return out

    def __call__(self, packed: Packed, *, receive: bool, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """The full tensors, in `order` (views of one buffer per dtype, on the device of this rank's pieces), or []
        where `receive` is off (after this rank's part of the collectives).

        Raises:
            RuntimeError: the ranks' pieces do not cover a tensor exactly once (a gatherer defect).
        """
        full: list[torch.Tensor] = []
        for dtype, members in self._groups.items():
            values = packed[dtype]
            all_places, lengths, gathered = _exchange(members.places, values, group)
            if not receive:
                continue
            route = self._routes.get(dtype)
            if route is None or route.lengths != lengths or not torch.equal(route.places, all_places):
                route = self._routes[dtype] = self._route(members, all_places, lengths, gathered.numel())
            if route.order is None:
                flat = gathered[: self._sizes[dtype]]
            else:
                parts = gathered.split(route.segments)
                flat = torch.cat([parts[k] for k in route.order])
            full += _unflatten_dense_tensors(flat.to(values.device), members.shapes)
        return full

    def _route(self, group: _Group, places: torch.Tensor, lengths: tuple[int, ...], size: int) -> _Route:
        """The route for this layout (see `_Route`), checked to cover each of the group's tensors exactly once."""
        offsets, total = [], 0
        for numel in group.numels:
            offsets.append(total)
            total += numel
        world = places.shape[0]
        longest = size // world if world else 0
        # (where it goes in the flat buffer, where it is in the gathered buffer, how many) for every piece.
        runs = []
        for r in range(world):
            at = r * longest
            for i, start, n in places[r].tolist():
                if i >= 0:
                    runs.append((offsets[i] + start, at, n))
                    at += n
        runs.sort()
        wrong: set[int] = set()
        merged: list[list[int]] = []
        end = 0
        for to, at, n in runs:
            if to > end:  # a gap before this run: the tensor holding its first element
                wrong.add(_owner(offsets, end))
            elif to < end:  # an overlap with the run before
                wrong.add(_owner(offsets, to))
            if merged and to == end and merged[-1][1] + merged[-1][2] == at:
                merged[-1][2] += n
            else:
                merged.append([to, at, n])
            end = max(end, to + n)
        if end != total:
            wrong.add(_owner(offsets, min(end, total - 1)))
        if wrong:
            named = sorted(group.names[i] for i in wrong)
            raise RuntimeError(f"the ranks' pieces do not cover these adapter weights exactly once: {few(named)}")
        if len(merged) <= 1 and (not merged or merged[0][1] == 0):
            return _Route(places.clone(), lengths, (), None)
        by_place = sorted(range(len(merged)), key=lambda k: merged[k][1])
        segments: list[int] = []
        index_of: dict[int, int] = {}
        at = 0
        for k in by_place:
            _, start, n = merged[k]
            if start > at:
                segments.append(start - at)  # padding, or values no run takes
            index_of[k] = len(segments)
            segments.append(n)
            at = start + n
        if at < size:
            segments.append(size - at)
        order = tuple(index_of[k] for k in range(len(merged)))
        return _Route(places.clone(), lengths, tuple(segments), order)


def _owner(offsets: list[int], position: int) -> int:
    """The tensor (its index in the group) that holds `position` of the group's flat buffer."""
    owner = 0
    for i, offset in enumerate(offsets):
        if offset <= position:
            owner = i
    return owner


def _resized(group: _Group, tensors: Sequence[torch.Tensor]) -> list[str]:
    """The names of held pieces whose tensors no longer have their planned size (where each tensor holds one piece;
    otherwise every name of the group, as no finer answer exists)."""
    if len(tensors) != len(group.held.places):
        return list(group.names)
    return [group.names[i] for (i, _, count), t in zip(group.held.places, tensors, strict=True) if t.numel() != count]


def few(names: Sequence[str], limit: int = 4) -> str:
    """The first `limit` of `names` for an error message, and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _exchange(
    places: torch.Tensor, values: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor]:
    """Every rank's places (world x most x 3, padded with -1), number of values, and values (padded to the
    longest, rank after rank): one all-gather each."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return places.reshape(1, -1, 3), (values.numel(),), values
    world = dist.get_world_size(group)
    # NOTE: on a gloo group (the sync's own, also on GPU trainers) the tensors travel through host memory, as the
    # sparse round's do: an adapter is small, and a group of its own can be aborted when a rank raises inside it
    # (the training group cannot). The full tensors are built on the pieces' device by the caller.
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else values.device
    sizes = torch.tensor([places.shape[0], values.numel()], dtype=torch.int64, device=device)
    all_sizes = torch.empty(world * 2, dtype=torch.int64, device=device)
    collective("adapter.pieces", dist.all_gather_into_tensor, all_sizes, sizes, group=group)
    rows, lengths = all_sizes.view(world, 2).t().tolist()
    most = max(max(rows), 1)
    padded_places = torch.full((most, 3), -1, dtype=torch.int64, device=device)
    padded_places[: places.shape[0]] = places
    out_places = torch.empty(world * most * 3, dtype=torch.int64, device=device)
    collective("adapter.pieces", dist.all_gather_into_tensor, out_places, padded_places.reshape(-1), group=group)
    longest = max(max(lengths), 1)
    padded = torch.zeros(longest, dtype=values.dtype, device=device)
    padded[: values.numel()] = values
    out_values = torch.empty(world * longest, dtype=values.dtype, device=device)
    collective("adapter.pieces", dist.all_gather_into_tensor, out_values, padded, group=group)
    return out_places.view(world, most, 3).cpu(), tuple(lengths), out_values
