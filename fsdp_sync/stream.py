"""The sync's data path as one object: the plan (checkpoint names, layout), the gather, the PEFT merge, the layout
conversion, the cast to the engine dtype, and the digests of what is sent.

Why one object: the sync pushes this stream into a writer, and `iter_full_weights` hands the same stream to the
caller with no engine behind it; both must see the same names, merge and cast, and both must stop the same way
when any rank fails (docs/failures.md). `WeightSync` decides what to send and agrees on the outcome; this module
only turns gathered shards into engine tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fsdp_sync.compat.layout import IdentityLayout, Layout
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
from fsdp_sync.compat.names import Dropped, NameRules, canonical_name

from .distributed import Rounds
from .errors import StreamInterrupted, SyncError, SyncTimeoutError
from .faults import fault_point
from .gather.base import GatherFailed, Gatherer
from .memory import MemoryMeter
from .peft_merge import PeftMerge
from .verify import EngineDigests

__all__ = ["IncompleteSyncError", "StreamPass", "SyncPlan", "WeightStream", "build_plan"]

logger = logging.getLogger(__name__)


class IncompleteSyncError(SyncError):
    """The gather produced a different set of parameters than planned (the model changed under the sync)."""


@dataclass(frozen=True)
class SyncPlan:
    """What every sync of one model structure sends; computed once from metadata.

    Attributes:
        tensors: the tensors pushed, by checkpoint name, with full specs and trainer sources.
        targets: trainer name -> canonical name (before the layout conversion), for every trainer parameter sent.
        dropped: trainer parameters not sent on purpose, with the reason.
    """

    tensors: tuple[PlannedTensor, ...]
    targets: dict[str, str]
    dropped: tuple[Dropped, ...] = field(default_factory=tuple)


def build_plan(gatherer: Gatherer, rules: NameRules, layout: Layout) -> SyncPlan:
    """The sync plan from metadata alone (names, shapes, dtypes; no gather), not yet checked against an engine."""
    canonical: dict[str, tuple[str, TensorSpec]] = {}
    dropped: list[Dropped] = []
    for trainer_name, spec in gatherer.specs().items():
        mapped = canonical_name(trainer_name, rules)
        if isinstance(mapped, Dropped):
            dropped.append(mapped)
        else:
            canonical[trainer_name] = (mapped, spec)
    tensors, targets = layout.plan(canonical)
    return SyncPlan(tensors=tuple(tensors), targets=targets, dropped=tuple(dropped))


class WeightStream:
    """Gathered trainer tensors -> `(checkpoint name, engine tensor)`, for one model.

    Args:
        gatherer: produces full tensors by trainer name.
        rules: name-mapping tables for this model.
        layout: converts trainer layout to checkpoint layout (identity for most models).
        merge: adds PEFT adapter deltas to their base weights (PEFT models only).
        dtype: the engine dtype floating tensors are cast to (None: keep the trainer's).
        meter: accounts the full tensors the stream holds.
    """

    def __init__(
        self,
        gatherer: Gatherer,
        *,
        rules: NameRules | None = None,
        layout: Layout | None = None,
        merge: PeftMerge | None = None,
        dtype: torch.dtype | None = None,
        meter: MemoryMeter,
    ) -> None:
        self.gatherer = gatherer
        self.rules = rules or NameRules()
        self.layout: Layout = layout or IdentityLayout()
        self.merge = merge
        self.dtype = dtype
        self.meter = meter

    def plan(self) -> SyncPlan:
        """The plan of this model (metadata only, no collective)."""
        return build_plan(self.gatherer, self.rules, self.layout)

    def open(
        self,
        plan: SyncPlan,
        rounds: Rounds,
        *,
        select: frozenset[str] | None = None,
        copy: bool = False,
        digests: EngineDigests | None = None,
    ) -> StreamPass:
        """One pass over the weights of `plan` (those in `select`, by trainer name, when given); the gather starts
        when the pass is first iterated, and runs the status rounds in `rounds`.

        Args:
            copy: copy each tensor out of the gatherer's storage (a consumer that keeps tensors past the next unit).
            digests: add every tensor sent to these digests (`SyncConfig.verify`).
        """
        return StreamPass(self, plan, rounds, select, copy, digests)


class StreamPass:
    """One pass of a `WeightStream`: iterate it for the engine tensors, then `drain()` whatever happened.

    A failure of any stage (the gather, the name mapping, the merge, the conversion, the cast) is recorded in the
    pass's `rounds` and raised into the consumer as `StreamInterrupted`, as is the end of a gather that another
    rank's failure stopped: the consumer must not take a stopped stream for a complete one. `drain()` runs this
    rank's remaining part of the gather (it stops at its next status round once any rank failed).

    Attributes:
        bytes, tensors: what was handed out so far.
    """

    def __init__(
        self,
        stream: WeightStream,
        plan: SyncPlan,
        rounds: Rounds,
        select: frozenset[str] | None,
        copy: bool,
        digests: EngineDigests | None,
    ) -> None:
        self.stream = stream
        self.plan = plan
        self.rounds = rounds
        self.select = select
        self.copy = copy
        self.digests = digests
        self.bytes = 0
        self.tensors = 0
        self._source = iter(stream.gatherer.iter_full(stream.meter, select, rounds))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream, plan, rounds = self.stream, self.plan, self.rounds
        dtype, meter, merge, copy = stream.dtype, stream.meter, stream.merge, self.copy
        dropped = {d.name for d in plan.dropped}
        merge_names = merge.names if merge is not None else frozenset()
        seen: set[str] = set()
        while True:
            try:
                trainer_name, tensor = next(self._source)
            except StopIteration:
                break
            except Exception as e:
                rounds.fail("gather", _as_gather_failure(e))
                raise StreamInterrupted(f"gather: {type(e).__name__}: {e}") from e
            stage = "map"
            try:
                fault_point("stream.map", name=trainer_name)
                target = plan.targets.get(trainer_name)
                if target is None:
                    if trainer_name in dropped:
                        continue
                    raise IncompleteSyncError(
                        f"Parameter {trainer_name!r} was gathered but is not in the sync plan; the model structure "
                        "changed after the first sync. Rebuild the sync (the mixin does this when the model object "
                        "changes)."
                    )
                seen.add(trainer_name)
                fresh = False
                if merge is not None and target in merge_names:
                    stage = "merge"
                    fault_point("stream.merge", name=target)
                    tensor = merge.apply(target, tensor)
                    meter.hold_until_freed(tensor)
                    fresh = True
                stage = "cast"
                fault_point("stream.cast", name=target)
                for name, out in stream.layout.convert(target, tensor):
                    cast_to = dtype if (dtype is not None and out.is_floating_point()) else out.dtype
                    owned = out.to(dtype=cast_to, copy=copy and not fresh)
                    if owned is not out:
                        meter.hold_until_freed(owned)
                    self.bytes += owned.numel() * owned.element_size()
                    self.tensors += 1
                    if self.digests is not None:
                        self.digests.add(name, owned)
                    yield name, owned
                    # NOTE: drop this frame's references before the gatherer is asked for the next unit, so that they
                    # do not keep the previous unit's buffer alive while the next one is gathered.
                    del out, owned
                del tensor
            except StreamInterrupted:
                raise
            except Exception as e:
                rounds.fail(stage, e)
                raise StreamInterrupted(f"{stage}: {type(e).__name__}: {e}") from e
        if rounds.stopped or rounds.failed:
            raise StreamInterrupted(f"the gather stopped: {_stopped(rounds)}")
        expected = set(plan.targets) if self.select is None else self.select & set(plan.targets)
        missing = sorted(expected - seen)
        if missing:
            error = IncompleteSyncError(
                f"{len(missing)} planned parameter(s) were never gathered: {', '.join(missing[:10])}"
                f"{' ...' if len(missing) > 10 else ''}. The model structure changed after the first sync."
            )
            rounds.fail("map", error)
            raise StreamInterrupted(f"map: {error}")

    def drain(self) -> None:
        """Run this rank's remaining part of the gather (it stops at its next status round once any rank failed)."""
        try:
            for _ in self._source:
                pass
        except Exception as e:
            self.rounds.fail("gather", _as_gather_failure(e))


def _stopped(rounds: Rounds) -> str:
    if rounds.failed:
        return f"this rank failed ({rounds.stage}: {type(rounds.error).__name__}: {rounds.error})"
    return f"rank(s) {', '.join(map(str, rounds.stopped_by))} failed"


def _as_gather_failure(error: Exception) -> Exception:
    """What escaped a gatherer, as the gather stage's failure: the flat gatherers record their own failures and
    never raise them (a timed-out wait is passed on as it is), so anything else died inside a collective the
    gatherer does not run itself (FSDP's own unshard)."""
    if isinstance(error, (GatherFailed, SyncTimeoutError)):
        return error
    failed = GatherFailed(
        f"{type(error).__name__}: {error} (this rank left the gather part-way, inside FSDP's own unshard: the other "
        "ranks may wait in that collective until the training process group's timeout; the flat strategies, the "
        "default, run their collectives themselves and never leave one part-way)"
    )
    failed.__cause__ = error
    return failed
