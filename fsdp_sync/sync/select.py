"""What one sync sends, chosen by a selection policy: one per sync mode, picked once when the sync is built.

Why policies: the sync's order of steps (plan, check, select, push, verify, settle, report: `pipeline.WeightSync`)
is the same in every mode; what differs is what a sync sends and what it must remember afterwards. A policy answers
`choose(plan)` with a `Payload` (what goes whole, what goes as patches, the figures the report needs), `settle` after
a successful push, and `forget` after a failure or `resync()`. Every rank makes the same choice (the choice decides
which collectives run), so a policy agrees with the other ranks inside `choose`.

- `Everything`: every sync complete (`SyncConfig(delta=False)`).
- `fsdp_sync.sync.delta.DeltaPolicy`: after one complete sync, what can have changed, proven every sync.
- `fsdp_sync.sync.sparse.SparsePolicy`: over delta, the engine-dtype elements that changed, as patches.

A new mode is a new module with a policy, and one line in `fsdp_sync.assemble.policy_for`; `WeightSync` does not
change for it (it imports no mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fsdp_sync.compat.engine_api import EngineLayout
from fsdp_sync.compat.manifest import PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch

if TYPE_CHECKING:
    from ..report import Figures
    from .stream import SyncPlan

__all__ = ["Everything", "Payload", "Selection", "SelectionPolicy", "Settled"]


@dataclass(frozen=True)
class Selection:
    """What one sync gathers and sends.

    Attributes:
        complete: every planned tensor (the first sync, after a failure or a structure change, or delta off).
        gather: trainer names to gather (None: all).
        tensors: the planned tensors sent, in stream order.
        skipped: planned tensors not sent.
        changed: trainer names among the skipped ones that changed since they were last pushed (sent this time).
    """

    complete: bool
    gather: frozenset[str] | None
    tensors: tuple[PlannedTensor, ...]
    skipped: tuple[PlannedTensor, ...] = ()
    changed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Payload:
    """What one sync sends, the same on every rank.

    Attributes:
        selection: the tensor-level choice: complete or not, what was skipped, which skipped weights changed.
        whole: the tensors sent whole, in stream order.
        gather: trainer names the stream gathers (None: every one). With `verify` a sparse sync also gathers what it
            patches (for the digests), and sends only `whole`.
        patches: the patches written after the whole tensors (None: no patch part; the stream then sends only
            `whole` of what it gathers, and nothing at all when `whole` is empty).
        fresh: everything remembered from the engine was dropped before this sync (a new policy state, an engine
            that was restarted or replaced): `verify` compares nothing with what it saw before.
        check_seconds: the policy's own checks before the push (the delta fingerprints and their agreement).
        patch_seconds: the policy's work before the push that counts as sync time (a sparse round: the diff, the
            counts, the patch collectives).
        detail: the policy's own record of this choice, for its `settle` and `report` (no one else reads it).
    """

    selection: Selection
    whole: tuple[PlannedTensor, ...]
    gather: frozenset[str] | None
    patches: tuple[EnginePatch, ...] | None = None
    fresh: bool = False
    check_seconds: float = 0.0
    patch_seconds: float = 0.0
    detail: Any = None


@dataclass(frozen=True)
class Settled:
    """Seconds of the local work after a successful push: the fingerprints of what was skipped, the snapshot."""

    check_seconds: float = 0.0
    snapshot_seconds: float = 0.0


class SelectionPolicy(Protocol):
    """Chooses what each sync sends, and remembers what it needs to choose the next.

    Attributes:
        needs_layout: the policy reads the engine's layout at plan time (`survey`, rank 0).
    """

    needs_layout: bool

    def survey(self, plan: SyncPlan, layout: EngineLayout | None) -> Any:
        """At plan time, on rank 0 (the rank that knows the engine, in every mode): what every rank must know of the
        engine to choose alike. Local work; what it returns is broadcast and handed to `adopt` on every rank."""
        ...

    def adopt(self, plan: SyncPlan, found: Any) -> None:
        """On every rank, after the plan was checked: take what rank 0's `survey` found."""
        ...

    def choose(self, plan: SyncPlan) -> Payload:
        """What this sync sends; runs collectives on every rank.

        Raises:
            SyncError: on every rank when any rank failed (nothing was sent; the engine is unchanged).
        """
        ...

    def settle(self, payload: Payload) -> Settled:
        """After the push of `payload` succeeded everywhere: remember what the next choice needs (local work; a
        failure here makes this rank's next choice complete, which the agreement spreads to every rank)."""
        ...

    def forget(self) -> None:
        """After a failed sync, or `resync()`: nothing the engine held is assumed any more; the next sync is
        complete (and dense)."""
        ...

    def report(self, payload: Payload, settled: Settled) -> tuple[Figures, ...]:
        """This mode's figures of the sync that sent `payload` and settled as `settled` (`SyncReport.figures`)."""
        ...


class Everything:
    """Every sync sends every planned tensor whole (`SyncConfig(delta=False)`)."""

    needs_layout = False

    def survey(self, plan: SyncPlan, layout: EngineLayout | None) -> None:
        return None

    def adopt(self, plan: SyncPlan, found: Any) -> None:
        pass

    def choose(self, plan: SyncPlan) -> Payload:
        return Payload(Selection(True, None, plan.tensors), plan.tensors, None)

    def settle(self, payload: Payload) -> Settled:
        return Settled()

    def forget(self) -> None:
        pass

    def report(self, payload: Payload, settled: Settled) -> tuple[Figures, ...]:
        return ()
