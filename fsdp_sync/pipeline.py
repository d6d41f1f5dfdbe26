"""One sync as data flowing: gatherer -> checkpoint names -> manifest check (once) -> cast -> engine writer -> report.

Failure behaviour (README "Failure behaviour"): whatever fails on one rank, every rank finishes its part of the
gathers, then all ranks agree on the outcome within `SyncConfig.sync_timeout_s`, and every rank raises one
`SyncError` naming each failing rank, its stage and its error, and what its own engine holds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from fsdp_sync.compat.layout import IdentityLayout, Layout
from fsdp_sync.compat.manifest import ManifestError as _CheckpointMismatch
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec, check_plan
from fsdp_sync.compat.names import Dropped, NameRules, canonical_name

from .delta import DeltaTracker, EngineGroups, Selection, nbytes
from .distributed import Coordinator, Rounds, rank
from .errors import (
    EngineState,
    agreed_error,
    describe_failures,
    ManifestError,
    NonFiniteWeightsError,
    RankFailure,
    StreamInterrupted,
    SyncError,
    SyncStageError,
    SyncTimeoutError,
    VerifyError,
)
from .faults import fault_point
from .gather.base import Gatherer, GatherFailed
from .memory import MemoryMeter
from .peft_merge import PeftMerge
from .report import SyncReport
from .verify import EngineDigests, VerifyResult
from .writers.base import EngineWriter

__all__ = ["IncompleteSyncError", "SyncPlan", "WeightSync", "build_plan"]

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


class WeightSync:
    """Joins one gatherer and one writer; `sync()` runs one complete push.

    Args:
        gatherer: produces full tensors by trainer name.
        writer: the engine transport.
        rules: name-mapping tables for this model.
        layout: converts trainer layout to checkpoint layout (identity for most models).
        merge: adds PEFT adapter deltas to their base weights (PEFT models only).
        backend: name of the detected backend, for reports.
        check_manifest: check the plan against the engine before the first push (strongly recommended).
        device: device of the full tensors, for memory measurement.
        timeout_s: the bound on each agreement between ranks (`SyncConfig.sync_timeout_s`).
        check_finite: refuse to push when a trainer weight holds NaN or Inf (`SyncConfig.check_finite`).
        verify: compare the engine's weight digests with what was sent after each push (`SyncConfig.verify`).
        delta: after a complete sync, send only what can have changed (`SyncConfig.delta`; `fsdp_sync.delta`).
        delta_check: with `delta`, prove every sync that the skipped weights did not change (`SyncConfig.delta_check`).
    """

    def __init__(
        self,
        gatherer: Gatherer,
        writer: EngineWriter,
        *,
        rules: NameRules | None = None,
        layout: Layout | None = None,
        merge: PeftMerge | None = None,
        backend: str = "",
        check_manifest: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
        check_finite: bool = False,
        verify: bool = False,
        delta: bool = False,
        delta_check: bool = True,
    ) -> None:
        self.gatherer = gatherer
        self.writer = writer
        self.rules = rules or NameRules()
        self.layout: Layout = layout or IdentityLayout()
        self.merge = merge
        self.backend = backend
        self.check_manifest = check_manifest
        self.check_finite = check_finite
        self.verify = verify
        self.meter = MemoryMeter(torch.device(device))
        self.coordinator = Coordinator(timeout_s)
        self._plan: SyncPlan | None = None
        self._digests: EngineDigests | None = None
        self.delta = delta
        self.delta_check = delta_check
        self._groups: EngineGroups | None = None
        self._delta: DeltaTracker | None = None
        self._prepared: tuple[PlannedTensor, ...] = ()

    @property
    def checked_plan(self) -> SyncPlan | None:
        """The plan once it has passed its check (first sync), else None; reading it runs no collective."""
        return self._plan

    def _agree(self, error: Exception | None, stage: str) -> list[RankFailure]:
        failure = RankFailure(rank(), stage, f"{type(error).__name__}: {error}") if error is not None else None
        return self.coordinator.agree(failure)

    def plan(self) -> SyncPlan:
        """Map every trainer parameter to its checkpoint name and check the result against the engine (cached).

        Raises:
            ManifestError: on any rank, for any mismatch; raised on every rank so that none enters a collective.
        """
        if self._plan is not None:
            return self._plan
        error: Exception | None = None
        plan: SyncPlan | None = None
        groups: EngineGroups | None = None
        try:
            fault_point("plan")
            plan = build_plan(self.gatherer, self.rules, self.layout)
            if self.check_manifest and self.writer.pushes:
                check_plan(plan.tensors, self.writer.manifest())
            if self.verify and self.writer.pushes:
                self._digests = self.writer.engine_digest_plan()
            if self.delta and rank() == 0:
                groups = self.writer.engine_groups()
            self.writer.prepare(plan.tensors)
        except Exception as e:  # every rank must learn of it before anyone gathers
            error = e
        failures = self._agree(error, "plan")
        if failures:
            unchanged = EngineState("unchanged") if self.writer.pushes else None
            text = f"The weight sync failed on {describe_failures(failures)}. Nothing was sent."
            if all(f.error.startswith(f"{_CheckpointMismatch.__name__}:") for f in failures):
                # NOTE: the failing ranks' own message lists every mismatched name; the others name the ranks.
                detail = str(error) if isinstance(error, _CheckpointMismatch) else text
                raise ManifestError(detail, failures=tuple(failures), engine=unchanged) from error
            raise agreed_error(error, failures, unchanged)
        assert plan is not None
        if self.delta:
            # NOTE: the selection decides which collectives run, so every rank must make the same one: the engine's
            # grouping is read where the engine is known (rank 0; in server mode only it talks to the server).
            self._groups = self.coordinator.broadcast(groups)  # type: ignore[assignment]
        for d in plan.dropped:
            logger.info("weight sync: not sending %s: %s", d.name, d.reason)
        self._prepared = plan.tensors
        self._plan = plan
        return plan

    def _selection(self, plan: SyncPlan) -> tuple[Selection, float]:
        """What this sync sends, the same on every rank: everything, or (delta) what can have changed plus whatever
        skipped weight changed since it was last pushed. Returns it with the seconds the check took."""
        if not self.delta:
            return Selection(True, None, plan.tensors), 0.0
        started = time.perf_counter()
        changed: list[str] = []
        error: Exception | None = None
        structure, primed = "", False
        try:
            fault_point("check")
            trainable = self.gatherer.trainable()
            tracker = self._delta
            if tracker is None or tracker.trainable != trainable:  # new, or the trainable set changed: complete first
                assert self._groups is not None
                merge_names = self.merge.names if self.merge is not None else frozenset()
                # NOTE: merge targets are the model's own names, the tracker's are checkpoint names; they differ
                # where transformers converts the layout at load (VLMs: `model.language_model.*` is `model.*` on disk).
                merged = frozenset(
                    t.name for t in plan.tensors if any(plan.targets.get(s) in merge_names for s in t.sources)
                )
                tracker = self._delta = DeltaTracker(plan.tensors, trainable, merged, self._groups)
            primed = tracker.primed
            if primed and self.delta_check:
                changed = tracker.changed(self._shards(tracker.watched))
            # NOTE: a stable digest (str hashes differ between processes).
            structure = hashlib.sha256("\n".join(sorted(trainable)).encode()).hexdigest()
        except Exception as e:
            error = e
        failure = None if error is None else RankFailure(rank(), "check", f"{type(error).__name__}: {error}")
        state = (structure, primed, changed, failure)
        states = self.coordinator.exchange(state)
        failures = [s[3] for s in states if s[3] is not None]  # type: ignore[index]
        if failures:
            raise agreed_error(error, failures, EngineState("unchanged") if self.writer.pushes else None)
        if len({s[0] for s in states}) > 1:  # type: ignore[index]
            raise SyncStageError(
                "The trainable parameters (requires_grad) differ between ranks; every rank must train the same ones "
                "(the ranks would gather different units). Nothing was sent."
            )
        seconds = time.perf_counter() - started
        tracker = self._delta
        assert tracker is not None
        if not all(s[1] for s in states):  # type: ignore[index]
            return tracker.complete(), seconds
        union = sorted({name for s in states for name in s[2]})  # type: ignore[index]
        if union:
            logger.warning(
                "weight sync: %d skipped weight(s) changed since they were last pushed; sending them: %s",
                len(union),
                ", ".join(plan.targets.get(n, n) for n in union),
            )
        return tracker.select(union), seconds

    def _shards(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shards of the named trainer parameters."""
        return self.gatherer.local_shards(names)

    def _record(self, selection: Selection) -> None:
        """After a successful push: fingerprint what was skipped (complete) or the skipped weights that were sent."""
        tracker = self._delta
        if tracker is None:
            return
        if selection.complete:
            tracker.mark_complete()
        if not self.delta_check:
            return
        try:
            if selection.complete:
                tracker.record(self._shards(tracker.watched))
            elif selection.changed:
                tracker.record(self._shards(selection.changed), only=selection.changed)
        except Exception as e:  # local work: the next sync's agreement sees this rank unprimed, and all go complete
            logger.warning("weight sync: could not fingerprint the skipped weights (%s); the next sync is complete", e)
            tracker.forget()

    def _check_finite(self, plan: SyncPlan) -> None:
        """Before anything is gathered: every rank looks for NaN/Inf in its own shards (no gather); the ranks agree,
        and if any rank found one, every rank raises naming the parameters, and nothing is sent."""
        error: Exception | None = None
        try:
            fault_point("check")
            # NOTE: min and max in one pass (`aminmax`): NaN propagates into both and an infinity is one of them, so
            # both are finite exactly when every element is; measured 30x faster than `isfinite(x).all()` on CPU
            # (no boolean temporary), and one host sync for all of them.
            flags = [
                (name, torch.stack(torch.aminmax(shard.detach())))
                for name, shard in self.gatherer.local_shards()
                if shard.numel() and shard.is_floating_point()
            ]
            stats = [f.float() for _, f in flags]
            if len({t.device for t in stats}) > 1:
                stats = [t.cpu() for t in stats]
            finite = torch.isfinite(torch.stack(stats)).all(dim=1).tolist() if stats else []
            bad = [plan.targets.get(name, name) for (name, _), ok in zip(flags, finite, strict=True) if not ok]
            if bad:
                error = NonFiniteWeightsError(f"NaN or Inf in this rank's shard of {len(bad)} weight(s): {', '.join(bad)}")
        except Exception as e:
            error = e
        failures = self._agree(error, "check")
        if failures:
            raise NonFiniteWeightsError(
                f"The weight sync refused to push non-finite weights: {describe_failures(failures)}. Nothing was "
                "sent; the engine keeps the previous sync's weights. Training has diverged (look at the loss, the "
                "learning rate, gradient clipping) or a weight was written outside training.",
                failures=tuple(failures),
                engine=EngineState("unchanged") if self.writer.pushes else None,
            )

    def _stream(
        self,
        plan: SyncPlan,
        source: Iterator[tuple[str, torch.Tensor]],
        counts: dict[str, int],
        rounds: Rounds,
        *,
        copy_all: bool = False,
        digests: EngineDigests | None = None,
        expected: frozenset[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under checkpoint names, cast to the engine dtype once; copied only where the writer keeps
        references and the gatherer frees storage at the next unit, or always with `copy_all` (a caller that keeps
        the last tensor while the next unit is gathered then holds that tensor, not its whole unit).

        A failure of any stage here (the gather, the name mapping, the merge, the conversion, the cast) is recorded
        in `rounds` and raised into the consumer as `StreamInterrupted`, as is the end of a gather that another
        rank's failure stopped: the consumer must not take a stopped stream for a complete one. The caller still
        drains `source` (it stops at its next status round).
        """
        dtype = self.writer.engine_dtype
        copy = copy_all or (self.writer.retains_tensors and not self.gatherer.tensors_outlive_step)
        dropped = {d.name for d in plan.dropped}
        merge_names = self.merge.names if self.merge is not None else frozenset()
        seen: set[str] = set()
        while True:
            try:
                trainer_name, tensor = next(source)
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
                if self.merge is not None and target in merge_names:
                    stage = "merge"
                    fault_point("stream.merge", name=target)
                    tensor = self.merge.apply(target, tensor)
                    self.meter.hold_until_freed(tensor)
                    fresh = True
                stage = "cast"
                fault_point("stream.cast", name=target)
                for name, out in self.layout.convert(target, tensor):
                    cast_to = dtype if (dtype is not None and out.is_floating_point()) else out.dtype
                    owned = out.to(dtype=cast_to, copy=copy and not fresh)
                    if owned is not out:
                        self.meter.hold_until_freed(owned)
                    counts["bytes"] += owned.numel() * owned.element_size()
                    counts["tensors"] += 1
                    if digests is not None:
                        digests.add(name, owned)
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
        missing = sorted((set(plan.targets) if expected is None else expected & set(plan.targets)) - seen)
        if missing:
            error = IncompleteSyncError(
                f"{len(missing)} planned parameter(s) were never gathered: {', '.join(missing[:10])}"
                f"{' ...' if len(missing) > 10 else ''}. The model structure changed after the first sync."
            )
            rounds.fail("map", error)
            raise StreamInterrupted(f"map: {error}")

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync's stream with no writer behind it (`fsdp_sync.full_weights`): full tensors under checkpoint
        names, cast, each its own copy; every rank must drain it (it runs the gathers).

        Raises:
            SyncError: on every rank when any rank failed (as `sync`).
        """
        plan = self.plan()
        self.meter.start()
        rounds = Rounds(self.coordinator)
        source = iter(self.gatherer.iter_full(self.meter, None, rounds))
        try:
            yield from self._stream(plan, source, {"bytes": 0, "tensors": 0}, rounds, copy_all=True)
        except StreamInterrupted:
            pass
        except GeneratorExit:
            # NOTE: the caller stopped reading part-way on this rank: the others still learn it at the next round
            # and in the agreement (they raise RemoteSyncError) instead of waiting for this rank's gathers.
            rounds.fail("map", RuntimeError("the caller stopped reading the full weights part-way"))
            self._drain(source, rounds)
            self._agree(rounds.error, "map")
            raise
        self._drain(source, rounds)
        failures = self._agree(rounds.error, rounds.stage or "map")
        if failures:
            raise agreed_error(rounds.error, failures, None)

    def _drain(self, source: Iterator[tuple[str, torch.Tensor]], rounds: Rounds) -> None:
        """Run this rank's remaining part of the gather (it stops at its next status round once any rank failed)."""
        try:
            for _ in source:
                pass
        except Exception as e:
            rounds.fail("gather", _as_gather_failure(e))

    def _push(
        self, plan: SyncPlan, counts: dict[str, int], digests: EngineDigests | None, selection: Selection
    ) -> EngineState | None:
        """Hand the stream to the writer, finish this rank's share of the gathers whatever happened, then agree with
        every rank on the outcome before anyone goes on.

        NOTE: the gather inside the stream is a sequence of collectives that every rank runs, with a status round
        before each unit's all-gather and before each gathered unit is handed on (`Rounds`). When anything on this
        rank fails part-way (its gather work, the mapping, the merge, the cast, the engine, the transport), the
        writer stops consuming and this rank says so at the next round, where every rank stops; units handed on
        before it were gathered whole on every rank. Then all ranks agree on the outcome, on a group of their own and
        within `sync_timeout_s`, so a failure on any rank is raised on every rank and none blocks.

        Returns:
            this rank's engine state (None on a rank that does not push).
        """
        rounds = Rounds(self.coordinator)
        if self.writer.pushes and selection.tensors != self._prepared:
            # Transports that announce tensors announce this sync's (a delta selection); local work, so a failure
            # stops every rank at the gather's first round.
            rounds.attempt("push", lambda: self.writer.prepare(selection.tensors))
            self._prepared = () if rounds.failed else selection.tensors
        source = iter(self.gatherer.iter_full(self.meter, selection.gather, rounds))
        engine: EngineState | None = None
        leftover = 0
        stream = self._stream(plan, source, counts, rounds, digests=digests, expected=selection.gather)
        try:
            if self.writer.pushes:
                rounds.attempt("push", lambda: fault_point("write"))  # the push starts
            if self.writer.pushes and not rounds.failed:
                try:
                    self.writer.write(_faulted(stream))
                    engine = EngineState("current")
                except Exception as e:
                    engine = e.engine if isinstance(e, SyncError) and e.engine is not None else EngineState("undefined")
                    if not isinstance(e.__cause__, StreamInterrupted) and not isinstance(e, StreamInterrupted):
                        rounds.fail("push", e)  # the engine or the transport itself
            elif not self.writer.pushes:
                # A rank that does not push consumes the stream itself (its figures are then its own).
                try:
                    for _ in stream:
                        pass
                except StreamInterrupted:
                    pass  # recorded in `rounds`
            elif engine is None:
                engine = EngineState("unchanged")
            if self.writer.pushes and engine is not None and engine.current:
                # A writer that returned early leaves the rest, which is counted.
                try:
                    leftover = sum(1 for _ in stream)
                except StreamInterrupted:
                    pass
            self._drain(source, rounds)
        except SyncTimeoutError as e:
            e.engine = engine
            raise
        if rounds.error is None and leftover and self.writer.pushes:
            rounds.fail("push", IncompleteSyncError(f"{self.writer.kind} stopped {leftover} tensor(s) before the end"))
        if rounds.error is None and not rounds.stopped and self.writer.pushes:
            try:
                fault_point("write.finish")
                self.writer.finish()
            except Exception as e:
                rounds.fail("push", e)
        try:
            failures = self._agree(rounds.error, rounds.stage or "push")
        except SyncTimeoutError as e:
            e.engine = engine
            raise
        if failures:
            raise agreed_error(rounds.error, failures, engine)
        return engine

    def _verify(self, digests: EngineDigests, pushed: EngineState | None) -> VerifyResult:
        """Compare the engine's own digests with what this rank sent; agreed on every rank. `pushed`: this rank's
        engine state after the push (what it still holds unless its digests differ)."""
        result: VerifyResult | None = None
        error: Exception | None = None
        try:
            fault_point("verify")
            replicas, sharded = self.writer.engine_digests()
            result = digests.compare(replicas, sharded=sharded)
            if result.mismatched:
                error = VerifyError(result.describe())
        except Exception as e:
            error = e
        failures = self._agree(error, "verify")
        if failures:
            engine = pushed
            if isinstance(error, VerifyError):  # the weights named in its message differ from what was sent
                engine = EngineState("undefined", note="the engine's weights differ from what was sent")
            raise agreed_error(error, failures, engine)
        assert result is not None or not self.writer.pushes
        return result or VerifyResult()

    def sync(self) -> SyncReport:
        """Gather, map, cast and push every parameter once; every rank must call it (it runs collectives).

        Raises:
            SyncError: on every rank when any rank failed (see `_push`); `NonFiniteWeightsError` before anything is
                sent with `check_finite`; `VerifyError` with `verify` when the engine differs from what was sent;
                `SyncTimeoutError` when a rank does not arrive in time.
        """
        plan = self.plan()
        if self.check_finite:
            self._check_finite(plan)
        selection, check_seconds = self._selection(plan)
        counts = {"bytes": 0, "tensors": 0}
        digests = self._digests
        if digests is not None:
            digests.reset()
        self.meter.start()
        start = time.perf_counter()
        try:
            pushed = self._push(plan, counts, digests, selection)
        except SyncError:
            if self._delta is not None:
                self._delta.forget()  # the engine may hold anything the failure left: the next sync is complete
            raise
        if self.meter.device.type == "cuda":
            torch.cuda.synchronize(self.meter.device)
        seconds = time.perf_counter() - start
        verified: VerifyResult | None = None
        verify_seconds = 0.0
        if self.verify:
            started = time.perf_counter()
            try:
                verified = self._verify(digests, pushed) if digests is not None else self._verify_elsewhere()
            except SyncError:
                if self._delta is not None:
                    self._delta.forget()
                raise
            verify_seconds = time.perf_counter() - started + (digests.seconds if digests is not None else 0.0)
            if verified.unverifiable:
                logger.warning("weight sync: %s", verified.describe_unverifiable())
        started = time.perf_counter()
        self._record(selection)
        check_seconds += time.perf_counter() - started
        return SyncReport(
            seconds=seconds,
            bytes=counts["bytes"],
            tensors=counts["tensors"],
            peak_extra_bytes=self.meter.peak_extra_bytes(),
            memory_source=self.meter.source,
            backend=self.backend,
            strategy=self.gatherer.strategy,
            writer=self.writer.kind,
            verified=verified.checked if verified is not None else None,
            unverifiable=len(verified.unverifiable) if verified is not None else None,
            verify_seconds=verify_seconds,
            complete=selection.complete,
            skipped_tensors=len(selection.skipped),
            skipped_bytes=nbytes(selection.skipped, self.writer.engine_dtype),
            changed_skipped=len(selection.changed),
            check_seconds=check_seconds,
        )

    def _verify_elsewhere(self) -> VerifyResult:
        """A rank that does not push takes part in the agreement on the pushing rank's verification."""
        failures = self._agree(None, "verify")
        if failures:
            raise agreed_error(None, failures, None)
        return VerifyResult()


def _faulted(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as the writer takes it, with the `write` fault point at every tensor."""
    for name, tensor in stream:
        fault_point("write", name=name)
        yield name, tensor


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
