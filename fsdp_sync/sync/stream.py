"""The sync's data path as one object: the plan (checkpoint names, layout), the gather, the PEFT merge, the layout
conversion, the cast to the engine dtype, and the digests of what is sent.

Why one object: the sync pushes this stream into a writer, and `iter_full_weights` hands the same stream to the
caller with no engine behind it; both must see the same names, merge and cast, and both must stop the same way
when any rank fails (docs/failures.md). `WeightSync` decides what to send and agrees on the outcome; this module
only turns gathered shards into engine tensors.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_sync.compat.layout import IdentityLayout, Layout
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
from fsdp_sync.compat.names import Dropped, NameRules, canonical_name

from ..distributed import Rounds
from ..errors import StreamInterrupted, SyncError, SyncTimeoutError
from ..faults import fault_point
from ..gather.base import GatherFailed, Gatherer
from ..memory import MemoryMeter
from ..peft_merge import PeftMerge
from .verify import EngineDigests

__all__ = ["IncompleteSyncError", "MergeInputs", "StreamPass", "SyncPlan", "WeightStream", "build_plan"]

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
        uncast: checkpoint names never cast (the engine keeps them wider than `dtype`).
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
        uncast: frozenset[str] = frozenset(),
    ) -> None:
        self.gatherer = gatherer
        self.uncast = uncast
        self.rules = rules or NameRules()
        self.layout: Layout = layout or IdentityLayout()
        self.merge = merge
        self.dtype = dtype
        self.meter = meter
        self._merge_inputs: tuple[SyncPlan, MergeInputs] | None = None

    def plan(self) -> SyncPlan:
        """The plan of this model (metadata only, no collective)."""
        return build_plan(self.gatherer, self.rules, self.layout)

    def merge_inputs(self, plan: SyncPlan) -> MergeInputs | None:
        """Which of the plan's dropped parameters are adapter weights the merge reads (None without a merge)."""
        if self.merge is None:
            return None
        if self._merge_inputs is None or self._merge_inputs[0] is not plan:
            self._merge_inputs = (plan, MergeInputs.of_plan(self.merge, plan))
        return self._merge_inputs[1]

    def open(
        self,
        plan: SyncPlan,
        rounds: Rounds,
        *,
        select: frozenset[str] | None = None,
        copy: bool = False,
        digests: EngineDigests | None = None,
        send: frozenset[str] | None = None,
    ) -> StreamPass:
        """One pass over the weights of `plan` (those in `select`, by trainer name, when given); the gather starts
        when the pass is first iterated, and runs the status rounds in `rounds`.

        Args:
            copy: copy each tensor out of the gatherer's storage (a consumer that keeps tensors past the next unit).
            digests: add every tensor of the pass to these digests (`SyncConfig.verify`).
            send: the engine tensors handed out (None: every one); the others are only added to `digests` (a
                sparse sync's patched tensors, gathered for verify) and are not counted as sent.
        """
        inputs = self.merge_inputs(plan)
        if inputs is not None and select is not None:
            # A merged base weight is sent with its adapters' weights, or it cannot be merged.
            select = select | inputs.needed_by(plan.targets.get(n) for n in select)
        return StreamPass(self, plan, rounds, select, copy, digests, send)


@dataclass(frozen=True)
class MergeInputs:
    """The adapter weights of one plan: which gathered (dropped) parameters the merge reads, and for which targets.

    Attributes:
        of: trainer name -> (the merge targets that read it, its name inside the tuner layer).
        needs: merge target -> trainer names of every adapter weight its delta reads.
    """

    of: dict[str, tuple[tuple[str, ...], str]]
    needs: dict[str, frozenset[str]]

    @classmethod
    def of_plan(cls, merge: PeftMerge, plan: SyncPlan) -> MergeInputs:
        of = {d.name: found for d in plan.dropped if (found := merge.adapter_weight(d.name)) is not None}
        needs: dict[str, set[str]] = {name: set() for name in merge.names}
        for trainer_name, (targets, _) in of.items():
            for target in targets:
                needs.setdefault(target, set()).add(trainer_name)
        return cls(of, {t: frozenset(n) for t, n in needs.items()})

    def needed_by(self, targets: Iterable[str | None]) -> frozenset[str]:
        return frozenset(n for t in targets if t is not None for n in self.needs.get(t, ()))


class _PendingMerges:
    """One pass's merge targets and adapter weights until both are in: the gather yields a unit's parameters in the
    model's order (a layer's base weight before its adapters), and adapters wrapped as units of their own come a
    unit later. Each adapter weight is dropped once every target that reads it has merged."""

    def __init__(self, inputs: MergeInputs) -> None:
        self.inputs = inputs
        self.bases: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._readers: dict[str, int] = {}

    def add_weight(self, trainer_name: str, tensor: torch.Tensor) -> list[str]:
        """Hold an adapter weight; the targets it completes."""
        targets, _ = self.inputs.of[trainer_name]
        self._weights[trainer_name] = tensor
        self._readers[trainer_name] = len(targets)
        return [t for t in targets if t in self.bases and self._complete(t)]

    def add_base(self, target: str, tensor: torch.Tensor) -> bool:
        """Hold a base weight; whether its adapter weights are all in."""
        self.bases[target] = tensor
        return self._complete(target)

    def _complete(self, target: str) -> bool:
        return self.inputs.needs.get(target, frozenset()) <= self._weights.keys()

    def take(self, target: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The base weight and the adapter weights (by name inside the layer) of a complete target, released."""
        weights: dict[str, torch.Tensor] = {}
        for trainer_name in self.inputs.needs.get(target, ()):
            weights[self.inputs.of[trainer_name][1]] = self._weights[trainer_name]
            self._readers[trainer_name] -= 1
            if self._readers[trainer_name] == 0:
                del self._weights[trainer_name], self._readers[trainer_name]
        return self.bases.pop(target), weights


class StreamPass:
    """One pass of a `WeightStream`: iterate it for the engine tensors, then `drain()` whatever happened.

    A failure of any stage (the gather, the name mapping, the merge, the conversion, the cast) is recorded in the
    pass's `rounds` and raised into the consumer as `StreamInterrupted`, as is the end of a gather that another
    rank's failure stopped: the consumer must not take a stopped stream for a complete one. `drain()` runs this
    rank's remaining part of the gather (it stops at its next status round once any rank failed).

    Attributes:
        bytes, tensors: what was handed out so far (a tensor only digested, outside `send`, is not counted).
    """

    def __init__(
        self,
        stream: WeightStream,
        plan: SyncPlan,
        rounds: Rounds,
        select: frozenset[str] | None,
        copy: bool,
        digests: EngineDigests | None,
        send: frozenset[str] | None = None,
    ) -> None:
        self.stream = stream
        self.plan = plan
        self.rounds = rounds
        self.select = select
        self.copy = copy
        self.digests = digests
        self.send = send
        self.bytes = 0
        self.tensors = 0
        self._source = iter(stream.gatherer.iter_full(stream.meter, select, rounds))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream, plan, rounds = self.stream, self.plan, self.rounds
        dtype, meter, merge, copy, send = stream.dtype, stream.meter, stream.merge, self.copy, self.send
        dropped = {d.name for d in plan.dropped}
        merge_names = merge.names if merge is not None else frozenset()
        inputs = stream.merge_inputs(plan)
        pending = _PendingMerges(inputs) if inputs is not None else None
        # [target, engine tensor in the trainer dtype (None while its merge waits for adapter weights), whether the
        # stream made it], in gather order: a writer may have announced that order (server mode), so a tensor after a
        # waiting merge target waits with it.
        queue: deque[list[Any]] = deque()
        waiting: dict[str, list[Any]] = {}
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
                ready: list[str] = []
                if target is None:
                    if trainer_name not in dropped:
                        raise IncompleteSyncError(
                            f"Parameter {trainer_name!r} was gathered but is not in the sync plan; the model "
                            "structure changed after the first sync. Rebuild the sync (the mixin does this when the "
                            "model object changes)."
                        )
                    if pending is not None and trainer_name in pending.inputs.of:
                        ready = pending.add_weight(trainer_name, tensor)
                else:
                    seen.add(trainer_name)
                    if pending is not None and target in merge_names:
                        queue.append(waiting.setdefault(target, [target, None, True]))
                        ready = [target] if pending.add_base(target, tensor) else []
                    else:
                        queue.append([target, tensor, False])
                del tensor
                for done in ready:
                    stage = "merge"
                    fault_point("stream.merge", name=done)
                    base, weights = pending.take(done)  # type: ignore[union-attr]
                    merged = merge.apply(done, base, weights)  # type: ignore[union-attr]
                    meter.hold_until_freed(merged)
                    waiting.pop(done)[1] = merged
                    del base, weights, merged
                stage = "cast"
                while queue and queue[0][1] is not None:
                    target, tensor, fresh = queue.popleft()
                    fault_point("stream.cast", name=target)
                    for name, converted in stream.layout.convert(target, tensor):
                        cast = dtype is not None and converted.is_floating_point() and name not in stream.uncast
                        cast_to = dtype if cast else converted.dtype
                        keep = converted.dtype == cast_to and not (copy and not fresh)  # `.to` would return it
                        owned = converted if keep else converted.to(dtype=cast_to, copy=copy and not fresh)
                        if owned is not converted:
                            meter.hold_until_freed(owned)
                        if self.digests is not None:
                            self.digests.add(name, owned)
                        if send is not None and name not in send:
                            del converted, owned
                            continue
                        self.bytes += owned.numel() * owned.element_size()
                        self.tensors += 1
                        yield name, owned
                        # NOTE: drop this frame's references before the gatherer is asked for the next unit, so that
                        # they do not keep the previous unit's buffer alive while the next one is gathered.
                        del converted, owned
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
        if pending is not None and pending.bases:
            waiting = sorted(pending.bases)
            error = IncompleteSyncError(
                f"{len(waiting)} merge target(s) never received their adapter weights: {', '.join(waiting[:10])}"
                f"{' ...' if len(waiting) > 10 else ''}. The adapters changed after the first sync (the mixin "
                "rebuilds the sync when the trainable set changes)."
            )
            rounds.fail("merge", error)
            raise StreamInterrupted(f"merge: {error}")

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
