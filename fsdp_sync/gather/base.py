"""The gatherer protocol: one per backend and strategy, each a generator of `(trainer_name, full_tensor)`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import torch
from torch import nn

from fsdp_sync.compat.manifest import TensorSpec

from ..memory import MemoryMeter

__all__ = ["FailureLatch", "GatherFailed", "Gatherer", "group_units", "local_named_parameters", "spec_of"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


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

    def iter_full(self, meter: MemoryMeter, select: frozenset[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every parameter's full tensor once (or only those named in `select`; units holding none of them are
        not gathered at all). Every rank must exhaust it, with the same `select`: it runs collectives."""
        ...

    def trainable(self) -> frozenset[str]:
        """Trainer names of the parameters that can change between syncs (`requires_grad`), without a collective."""
        ...

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's own part of every parameter (or of those named), by the trainer names of `specs`, without any
        collective (empty where the rank holds none of it); for checks that need no gather (`check_finite`, the
        delta check)."""
        ...


class GatherFailed(RuntimeError):
    """This rank's own gather work failed (the original error is the cause).

    Attributes:
        completed: True when this rank still ran every remaining collective of the gather, so no other rank waits
            for it and the training process group stays usable; False when it left the gather part-way (inside
            FSDP's own unshard), so the other ranks may wait in that collective until the process group's timeout.
        placeholders: trainer names of the parameters whose all-gather this rank joined with placeholder data (its
            own shard could not be prepared): the other ranks received undefined values for them.
    """

    def __init__(self, message: str, *, completed: bool, placeholders: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.completed = completed
        self.placeholders = placeholders


class FailureLatch:
    """Remembers the first failure of a gatherer's own (non-collective) work on this rank, so the gatherer can run
    its remaining collectives, yield nothing more, and raise `GatherFailed` at the end."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.placeholders: list[str] = []

    @property
    def failed(self) -> bool:
        return self.error is not None

    def reset(self) -> None:
        self.error = None
        self.placeholders = []

    def _record(self, error: Exception) -> None:
        if self.error is None:
            logger.error(
                "weight sync: this rank's gather work failed; it runs the remaining all-gathers and then fails the "
                "sync on every rank",
                exc_info=error,
            )
            self.error = error
        # NOTE: a stored traceback keeps its frames and their callers' frames alive, with their locals: here the
        # gatherer's own frames, which hold the unit's buffers and the in-flight Work (measured: a gathered buffer
        # pinned for the whole gather, and gloo's release wait running into its 1 s bound). It was logged above.
        error.__traceback__ = None

    def run(self, work: Callable[[], _T]) -> _T | None:
        """Work that only this rank needs (after a collective): `work()`, or None when it raises (recorded) or when
        a failure was recorded before (then it is not run: this rank yields nothing more)."""
        if self.error is not None:
            return None
        try:
            return work()
        except Exception as e:
            self._record(e)
            return None

    def attempt(self, work: Callable[[], _T], names: list[str]) -> _T | None:
        """Work whose result the other ranks receive (a shard before its all-gather): always tried, even after a
        failure, so that the other ranks get real data wherever this rank can still provide it; None when it
        raises (recorded, and `names` listed as joined with placeholders)."""
        try:
            return work()
        except Exception as e:
            self._record(e)
            self.placeholders += names
            return None

    def raise_if_failed(self, *, completed: bool) -> None:
        if self.error is not None:
            error, placeholders = self.error, tuple(self.placeholders)
            self.reset()
            raise GatherFailed(
                f"{type(error).__name__}: {error}", completed=completed, placeholders=placeholders
            ) from error


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
