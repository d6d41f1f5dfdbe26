"""Full tensors from every rank's disjoint pieces: an adapter sync's exchange (`adapter.pieces`), with what it needs
per tensor worked out once per layout and reused by every later sync.

Why a kept route: a piece's place in the full tensors is fixed by the FSDP sharding, so placing each piece with its
own copy, in a Python loop, repeated work that does not change between syncs; with many small tensors (an adapter on
every linear layer: 392 tensors of a few KB) that loop and the per-piece tensor bookkeeping were most of the
exchange's time. Every sync still exchanges the layout (two small all-gathers: a layout that changed is seen on
every rank alike, and the collectives the failure model counts stay the same); the route is rebuilt only when it
changed. A sync then costs one concatenation of this rank's pieces, the values' all-gather, and one concatenation
that puts the gathered runs in their order (runs that follow each other in both places merged: at world size 1,
or wherever the pieces already lie in order, the gathered buffer is the result and nothing is copied), split into
the full tensors.

NOTE: the route is kept per run (a piece, or merged pieces), not per element: an element index would cost 8 bytes
an element (four times a bf16 adapter) and its own pass over them; measured on one H100, a route of element indices
made a 7B all-linear adapter sync (80.74 MB) slower than the per-piece copies it replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import collective
from ..gather.base import Piece

__all__ = ["PieceExchange"]


@dataclass(frozen=True)
class _Route:
    """For one dtype and one layout of every rank's pieces: the gathered buffer cut into `segments` (its runs and
    the gaps between them), and `order`, the segments that make the dtype's flat buffer, in its order (None: the
    gathered buffer's first elements are that buffer already)."""

    places: torch.Tensor  # every rank's (index, start, count) rows, as gathered (padded with -1)
    lengths: tuple[int, ...]  # every rank's number of values
    segments: tuple[int, ...]
    order: tuple[int, ...] | None
    names: tuple[str, ...]
    numels: tuple[int, ...]


class PieceExchange:
    """Exchanges every rank's pieces of `names` into full (flat) tensors; one per plan, called once per sync.

    Every rank must call it with the same `names`, `numels` and `dtypes` (metadata every rank has), inside
    `Coordinator.run` on the sync's own group (`adapter.pieces`): three all-gathers per dtype (sizes, the pieces'
    places, their values), whatever the number of tensors.
    """

    def __init__(self, names: Sequence[str], numels: Sequence[int], dtypes: Sequence[torch.dtype]) -> None:
        self.names = tuple(names)
        self.numels = tuple(numels)
        self.dtypes = tuple(dtypes)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._routes: dict[torch.dtype, _Route] = {}
        self._sent: dict[torch.dtype, tuple[tuple[tuple[int, int, int], ...], torch.Tensor]] = {}

    def __call__(
        self, pieces: Iterable[Piece], *, receive: bool, group: dist.ProcessGroup | None = None
    ) -> dict[str, torch.Tensor]:
        """The full tensors of every name (flat, on the device of this rank's pieces), or {} where `receive` is off
        (after this rank's part of the collectives).

        Raises:
            RuntimeError: the ranks' pieces do not cover a tensor exactly once (a gatherer defect).
        """
        mine: dict[torch.dtype, list[tuple[int, Piece]]] = {dtype: [] for dtype in set(self.dtypes)}
        for p in pieces:
            if p.values.numel():
                i = self._index[p.name]
                mine[self.dtypes[i]].append((i, p))
        full: dict[str, torch.Tensor] = {}
        for dtype in sorted(mine, key=str):
            chosen = sorted(mine[dtype], key=lambda item: item[0])
            device = chosen[0][1].values.device if chosen else torch.device("cpu")
            places = self._places(dtype, tuple((i, p.start, p.values.numel()) for i, p in chosen))
            values = (
                torch.cat([p.values.reshape(-1) for _, p in chosen]).to(dtype) if chosen else torch.empty(0, dtype=dtype)
            )
            all_places, lengths, gathered = _exchange(places, values.to(device), group)
            if not receive:
                continue
            route = self._routes.get(dtype)
            if route is None or route.lengths != lengths or not torch.equal(route.places, all_places):
                route = self._routes[dtype] = self._route(dtype, all_places, lengths, gathered.numel())
            if route.order is None:
                flat = gathered[: sum(route.numels)]
            else:
                parts = gathered.split(route.segments)
                flat = torch.cat([parts[k] for k in route.order])
            full.update(zip(route.names, flat.to(device).split(route.numels), strict=True))
        return full

    def _places(self, dtype: torch.dtype, rows: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """This rank's (index, start, count) rows as a tensor, kept while they do not change."""
        kept = self._sent.get(dtype)
        if kept is None or kept[0] != rows:
            kept = self._sent[dtype] = (rows, torch.tensor(rows, dtype=torch.int64).reshape(-1, 3))
        return kept[1]

    def _route(self, dtype: torch.dtype, places: torch.Tensor, lengths: tuple[int, ...], size: int) -> _Route:
        """The route for this layout (see `_Route`), checked to cover each tensor exactly once."""
        members = [i for i, d in enumerate(self.dtypes) if d == dtype]
        offsets, total = {}, 0
        for i in members:
            offsets[i], total = total, total + self.numels[i]
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
                wrong.add(self._owner(members, offsets, end))
            elif to < end:  # an overlap with the run before
                wrong.add(self._owner(members, offsets, to))
            if merged and to == end and merged[-1][1] + merged[-1][2] == at:
                merged[-1][2] += n
            else:
                merged.append([to, at, n])
            end = max(end, to + n)
        if end != total:
            wrong.add(self._owner(members, offsets, min(end, total - 1)))
        if wrong:
            named = sorted(self.names[i] for i in wrong)
            raise RuntimeError(f"the ranks' pieces do not cover these adapter weights exactly once: {few(named)}")
        names = tuple(self.names[i] for i in members)
        numels = tuple(self.numels[i] for i in members)
        if len(merged) <= 1 and (not merged or merged[0][1] == 0):
            return _Route(places.clone(), lengths, (), None, names, numels)
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
        return _Route(places.clone(), lengths, tuple(segments), order, names, numels)

    def _owner(self, members: list[int], offsets: dict[int, int], position: int) -> int:
        """The tensor (of `members`) that holds `position` of the flat buffer."""
        owner = members[0]
        for i in members:
            if offsets[i] <= position:
                owner = i
        return owner


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
