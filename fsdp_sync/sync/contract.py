"""The one contract every sync kind keeps with the mixin (`Sync`), and the writer's share of the sync's deadline.

Why a contract: complete, delta and sparse syncs (`pipeline.WeightSync`) and adapter syncs (`adapter.AdapterSync`)
send different things through the one sync body (`frame.SyncFrame`), and the mixin drives them alike: it builds one, calls `sync()` on every rank, records its
report or its failure (named by `backend`, `strategy` and `writer_kind`), and asks it for `resync()`, the plan and
the adapter generation must name. It never asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..report import SyncReport
    from ..writers.base import EngineWriter
    from .stream import SyncPlan

__all__ = ["PublishHook", "Sync", "writer_budget"]

# What the trainer moves when a sync commits (its own versions: `trainers.base.TrainerSeam.publisher`), called on
# every rank that learns the sync landed, with the adapter version the sync published (None for weights).
PublishHook = Callable[[int | None], None]


class Sync(Protocol):
    """One sync kind, built once per model; every rank calls `sync()`.

    Attributes:
        backend: the detected backend's name.
        strategy: how the weights are gathered (the gatherer's strategy; an adapter sync's pieces exchange).
        writer: the engine writer (its `pushes`: whether this rank writes into an engine).
        writer_kind: where the weights go, as reports and logs name it.
        serves_adapter: generation must ask for the adapter the last sync loaded (`adapter_request`).
        adapter_prefix: the adapter versions it pushes are named `<adapter_prefix>-v<N>`, N its version (None for a
            sync that pushes no adapter).
        on_publish: what the trainer moves at each sync's commit point (`PublishHook`: its own versions,
            with the engine's); None: nothing.
    """

    backend: str
    writer: EngineWriter
    on_publish: PublishHook | None

    @property
    def strategy(self) -> str: ...

    @property
    def writer_kind(self) -> str: ...

    @property
    def serves_adapter(self) -> bool: ...

    @property
    def adapter_prefix(self) -> str | None: ...

    @property
    def sync_plan(self) -> SyncPlan | None:
        """What each sync sends by trainer and checkpoint name, once checked (None before, and for a kind without
        one: an adapter sync's plan is its `AdapterPlan`)."""
        ...

    def sync(self) -> SyncReport:
        """One sync; raises `SyncError` on every rank when any rank failed."""
        ...

    def resync(self) -> None:
        """Make the next sync send everything (the engine was changed outside this trainer)."""
        ...

    def adapter_request(self) -> object | None:
        """What generation passes to be served the adapter loaded last (None where none is)."""
        ...


def writer_budget(sync_timeout_s: float) -> float:
    """How long a writer's own waits may take in one sync: the sync's bound, less a margin in which the ranks still
    agree before any of them gives up on the others (they wait `sync_timeout_s` at each status round)."""
    return sync_timeout_s - min(2.0, 0.1 * sync_timeout_s)
