"""The gatherer protocol: one per backend and strategy, each a generator of `(trainer_name, full_tensor)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from fsdp_sync.compat.manifest import TensorSpec

from ..distributed import Coordinator, Rounds, world_size
from ..memory import MemoryMeter

__all__ = [
    "GatherFailed",
    "Gatherer",
    "HeldPieces",
    "Piece",
    "replica_held",
    "group_units",
    "local_named_parameters",
    "replica_piece",
    "spec_of",
    "sync_rounds",
    "until_failed",
]


@dataclass(frozen=True)
class Piece:
    """This rank's part of one full tensor: `values` (1-D) is `full.flatten()[start : start + values.numel()]`.

    A rank that holds a replica rather than its own part (DDP, a parameter FSDP ignores, a replicated mesh dimension)
    gives an empty piece on every rank but one, so that pieces stay disjoint.
    """

    name: str
    values: torch.Tensor
    start: int


def replica_piece(name: str, tensor: torch.Tensor, reporter: bool) -> Piece:
    """The piece of a tensor every rank holds whole: all of it on the one rank that reports it, empty elsewhere."""
    flat = tensor.detach().reshape(-1)
    return Piece(name, flat if reporter else flat[:0], 0)


@dataclass(frozen=True)
class HeldPieces:
    """This rank's pieces of a fixed list of names, laid out once (an adapter sync's, `fsdp_sync.sync.pieces`), so
    that each sync reads them without any per-tensor bookkeeping.

    Attributes:
        places: (index into the names, start in the flattened full tensor, count) of each non-empty piece this rank
            holds, in the order `read` returns their values; the same every sync.
        read: this sync's tensors holding those values: flattened and concatenated they are the pieces' values in
            `places` order (a tensor may hold several consecutive pieces). Cheap: views of the parameters' storage.
    """

    places: tuple[tuple[int, int, int], ...]
    read: Callable[[], Sequence[torch.Tensor]]


def replica_held(tensors: Sequence[torch.Tensor], reporter: bool) -> HeldPieces:
    """`HeldPieces` of tensors every rank holds whole (the parameter objects, read as they are at each sync): all of
    each on the one rank that reports them, nothing elsewhere (pieces stay disjoint)."""
    if not reporter:
        return HeldPieces((), tuple)
    kept = [(i, t) for i, t in enumerate(tensors) if t.numel()]
    held = [t for _, t in kept]
    return HeldPieces(tuple((i, 0, t.numel()) for i, t in kept), lambda: held)


class Gatherer(Protocol):
    """Produces the full value of every trainer parameter, with bounded memory.

    Attributes:
        strategy: the strategy's name, for reports (e.g. `"fsdp1-unit"`).
        tensors_outlive_step: True when a yielded tensor stays valid after the generator moves on (plain modules,
            a root summon); False when its storage is freed at the next unit (per-unit strategies), so a consumer
            that keeps it must copy it.
    """

    strategy: str
    tensors_outlive_step: bool

    def specs(self) -> dict[str, TensorSpec]:
        """Full shapes and dtypes by trainer name, from metadata alone (no collective, no gather), in the order
        `iter_full` yields them (transports that announce tensors before sending them rely on it)."""
        ...

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every parameter's full tensor once (or only those named in `select`; units holding none of them are
        not gathered at all). Every rank must exhaust it, with the same `select`: it runs collectives. `rounds`:
        the sync's status rounds (this rank's failures, and the rounds every rank runs between units, see
        `Rounds`); the gatherer stops on every rank at the round after any rank failed."""
        ...

    def trainable(self) -> frozenset[str]:
        """Trainer names of the parameters that can change between syncs (`requires_grad`), without a collective."""
        ...

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's own part of every parameter (or of those named), by the trainer names of `specs`, without any
        collective (empty where the rank holds none of it); for checks that need no gather (`check_finite`, the
        delta check)."""
        ...

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        """This rank's own part of each named parameter as a contiguous run of the flattened full tensor, without
        any collective (sparse delta syncs, `fsdp_sync.sync.sparse`); the ranks' pieces are disjoint (a replica that is
        not this rank's to report is an empty piece), and their union is the whole tensor."""
        ...

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        """This rank's pieces of `names` (as `local_pieces` gives them), laid out once for syncs that read the same
        pieces every time (adapter syncs); no collective.

        Why beside `local_pieces`: listing pieces costs microseconds a tensor (a generator step, a `to_local()`, a
        slice, a `Piece`), and an adapter has hundreds of small tensors whose whole payload moves in less time.
        """
        ...


class GatherFailed(RuntimeError):
    """This rank left a gather part-way, inside a collective it does not run itself (FSDP's own unshard in the
    `unit`/`root`/`param` strategies): the other ranks may wait in that collective until the training process
    group's timeout. The original error is the cause."""


def sync_rounds(rounds: Rounds | None, timeout_s: float = 600.0) -> Rounds:
    """The sync's status rounds, or a gather's own when it is called outside a sync (every rank calls it at the same
    point; the control group is created once per timeout)."""
    if rounds is not None:
        return rounds
    return Rounds(Coordinator(timeout_s) if world_size() > 1 else None)


def until_failed(rounds: Rounds, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`items`, until this rank has failed (the consumer stopped): nothing more is handed on after that."""
    for item in items:
        if rounds.failed:
            return
        yield item


def spec_of(param: torch.Tensor) -> TensorSpec:
    """Full shape and dtype; a DTensor reports its global shape without communication."""
    return TensorSpec(tuple(param.shape), param.dtype)


def local_named_parameters(
    unit: nn.Module, prefix: str, is_unit: type | tuple[type, ...]
) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters owned by `unit`'s own modules, not descending into nested units of type `is_unit`.

    Tied parameters are yielded under every name they have; callers keep the names they planned.
    """
    stack: list[tuple[str, nn.Module]] = [(prefix, unit)]
    while stack:
        path, module = stack.pop()
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            yield (f"{path}.{name}" if path else name), param
        children = [
            (f"{path}.{child_name}" if path else child_name, child)
            for child_name, child in module.named_children()
            if not isinstance(child, is_unit)
        ]
        stack.extend(reversed(children))


def group_units(
    model: nn.Module, unit_paths: list[str], merge_scopes: tuple[type, ...] = ()
) -> list[tuple[str, list[str]]]:
    """Group units that must be full at the same time, parents first.

    A unit nested inside a module of a `merge_scopes` type (e.g. a PEFT tuner layer whose `lora_A` an auto-wrap
    policy made its own unit) is a companion of its enclosing unit: it is gathered together with it, so that the
    adapter and its base weight are full at once.

    Returns:
        (main unit path, companion unit paths) per visit, in pre-order of the main units.
    """
    if not merge_scopes:
        return [(p, []) for p in unit_paths]
    modules = dict(model.named_modules())
    units = set(unit_paths)

    def prefixes(path: str) -> list[str]:
        parts = path.split(".") if path else []
        return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]

    main_of: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for path in unit_paths:
        ancestors = [q for q in prefixes(path) if q in units and q != path]
        enclosing = ancestors[-1] if ancestors else None
        between = [q for q in prefixes(path) if enclosing is not None and len(q) > len(enclosing) and q != ""]
        if enclosing is not None and any(isinstance(modules[q], merge_scopes) for q in between):
            main = main_of[enclosing]
            main_of[path] = main
            groups[main].append(path)
        else:
            main_of[path] = path
            groups[path] = []
    return list(groups.items())
