"""One sync: decide what to send (everything, or a delta), push the weight stream into the engine writer, agree
on the outcome on every rank, verify on request, report.

Failure behaviour (docs/failures.md): whatever fails on one rank, every rank finishes its part of the
gathers, then all ranks agree on the outcome within `SyncConfig.sync_timeout_s`, and every rank raises one
`SyncError` naming each failing rank, its stage and its error, and what its own engine holds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from fsdp_sync.compat.engine_api import EngineLayout
from fsdp_sync.compat.layout import Layout
from fsdp_sync.compat.manifest import ManifestError as _CheckpointMismatch
from fsdp_sync.compat.manifest import PlannedTensor, check_plan
from fsdp_sync.compat.names import NameRules

from .config import SyncConfig
from .delta import DeltaTracker, EngineGroups, Selection, nbytes
from .distributed import Coordinator, Rounds, own_failure, rank, world_size
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
from .gather.base import Gatherer
from .memory import MemoryMeter
from .peft_merge import PeftMerge
from .report import SyncReport
from .sparse import Patch
from .sparse_sync import SparseRound, SparseTracker, patchable_tensors
from .stream import IncompleteSyncError, StreamPass, SyncPlan, WeightStream
from .verify import EngineDigests, VerifyResult
from .versions import VersionStamps
from .writers.base import BoundedWriter, EngineWriter, VersionedWriter

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# What `WeightSync` does when given no config: every sync complete (the mixin passes the user's `SyncConfig`,
# whose default is delta syncs).
_COMPLETE = SyncConfig(delta=False)


class WeightSync:
    """Joins one weight stream and one writer; `sync()` runs one push.

    Args:
        gatherer: produces full tensors by trainer name.
        writer: the engine transport.
        config: the sync's options (`check_manifest`, `sync_timeout_s`, `check_finite`, `verify`, `delta`,
            `delta_check`); without one, every sync is complete and nothing optional runs.
        rules: name-mapping tables for this model.
        layout: converts trainer layout to checkpoint layout (identity for most models).
        merge: adds PEFT adapter deltas to their base weights (PEFT models only).
        backend: name of the detected backend, for reports.
        device: device of the full tensors, for memory measurement.
        uncast: checkpoint names sent in the trainer's dtype (the engine keeps them wider than its own dtype:
            `EngineManifest.wider`); never patched (a patch carries engine-dtype values).
    """

    def __init__(
        self,
        gatherer: Gatherer,
        writer: EngineWriter,
        config: SyncConfig | None = None,
        *,
        rules: NameRules | None = None,
        layout: Layout | None = None,
        merge: PeftMerge | None = None,
        backend: str = "",
        device: torch.device | str = "cpu",
        uncast: frozenset[str] = frozenset(),
    ) -> None:
        self.config = config or _COMPLETE
        self.gatherer = gatherer
        self.writer = writer
        self.backend = backend
        self.meter = MemoryMeter(torch.device(device))
        self.uncast = uncast
        self.stream = WeightStream(
            gatherer, rules=rules, layout=layout, merge=merge, dtype=writer.engine_dtype, meter=self.meter, uncast=uncast
        )
        self.coordinator = Coordinator(self.config.sync_timeout_s)
        # Decided once: whether the engine keeps weight versions (stamped after every push, checked before every
        # delta or sparse sync: `fsdp_sync.versions`), and whether the writer has waits outside this process to
        # bound by the sync's deadline (a server).
        self._versioned = writer if writer.pushes and isinstance(writer, VersionedWriter) else None
        self._bounded = writer if writer.pushes and isinstance(writer, BoundedWriter) else None
        self._stamps = VersionStamps()
        self._plan: SyncPlan | None = None
        self._digests: EngineDigests | None = None
        self._groups: EngineGroups | None = None
        self._delta: DeltaTracker | None = None
        self._sparse: SparseTracker | None = None
        self._prepared: tuple[PlannedTensor, ...] = ()

    @property
    def merge(self) -> PeftMerge | None:
        return self.stream.merge

    @property
    def checked_plan(self) -> SyncPlan | None:
        """The plan once it has passed its check (first sync), else None; reading it runs no collective."""
        return self._plan

    def _agreed(
        self,
        stage: str,
        work: Callable[[], _T],
        failed: Callable[[Exception | None, list[RankFailure]], SyncError],
    ) -> _T:
        """`work()` on this rank, then every rank agrees on whether it succeeded everywhere; when it failed on any
        rank, every rank raises `failed(this rank's error or None, the failures)`.

        Why: work before (or after) the gathers that can fail on one rank alone must never leave the other ranks
        in a collective: nobody goes on until all said how it went.
        """
        result: _T | None = None
        error: Exception | None = None
        try:
            result = work()
        except Exception as e:
            error = e
        failures = self.coordinator.agree_on(stage, error)
        if failures:
            raise failed(error, failures)
        return result  # type: ignore[return-value]

    def _unchanged(self) -> EngineState | None:
        return EngineState("unchanged") if self.writer.pushes else None

    def plan(self) -> SyncPlan:
        """Map every trainer parameter to its checkpoint name and check the result against the engine (cached).

        Raises:
            ManifestError: on any rank, for any mismatch; raised on every rank so that none enters a collective.
        """
        if self._plan is not None:
            return self._plan
        config, writer = self.config, self.writer

        def work() -> tuple[SyncPlan, EngineGroups | None]:
            fault_point("plan")
            plan = self.stream.plan()
            if config.check_manifest and writer.pushes:
                check_plan(plan.tensors, writer.manifest())
            verifies, groups_here = config.verify and writer.pushes, config.delta and rank() == 0
            layout = writer.engine_layout() if verifies or groups_here else None
            if verifies:
                self._digests = EngineDigests.of(layout)
            groups = EngineGroups.of(layout) if groups_here else None
            sparse = self._patchable(plan, layout) if config.sparse and groups_here else None
            writer.prepare(plan.tensors)
            return plan, (groups, sparse)

        def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
            text = f"The weight sync failed on {describe_failures(failures)}. Nothing was sent."
            if all(f.error.startswith(f"{_CheckpointMismatch.__name__}:") for f in failures):
                # NOTE: the failing ranks' own message lists every mismatched name; the others name the ranks.
                detail = str(error) if isinstance(error, _CheckpointMismatch) else text
                failure = ManifestError(detail, failures=tuple(failures), engine=self._unchanged())
                failure.__cause__ = error
                return failure
            return agreed_error(error, failures, self._unchanged())

        plan, found = self._agreed("plan", work, failed)
        if config.delta:
            # NOTE: the selection decides which collectives run, so every rank must make the same one: the engine's
            # grouping is read where the engine is known (rank 0; in server mode only it talks to the server).
            self._groups, sparse = self.coordinator.broadcast(found)  # type: ignore[misc]
            self._sparse = self._sparse_tracker(plan, sparse) if config.sparse else None
        for d in plan.dropped:
            logger.info("weight sync: not sending %s: %s", d.name, d.reason)
        self._prepared = plan.tensors
        self._plan = plan
        return plan

    def _patchable(self, plan: SyncPlan, layout: EngineLayout) -> tuple[frozenset[str], dict[str, str]]:
        """Which planned tensors may travel as patches, and why the others cannot (rank 0, at plan time)."""
        refusal = self.writer.sparse_refusal()
        if refusal is None and self.merge is not None:
            refusal = "PEFT adapters are merged into their base weights on the way (delta syncs already skip what cannot change)"
        if refusal is not None:
            return frozenset(), {"*": refusal}
        engine_refusals = self.writer.patch_refusals()
        wider = "the engine keeps it wider than its dtype (patches carry engine-dtype values)"
        elsewhere = (
            "the engine has no parameter where its name says (its loader renames or restacks it, as gpt-oss's expert "
            "stacks), so where a patch lands is not known"
        )
        lands_in = layout.lands_in or {}
        refused: dict[str, str] = {}
        for t in plan.tensors:
            # NOTE: where the engine's loader was run dry, the parameters it writes; else the name's own parameter
            # (renamed and fused as vLLM does), which misses loaders that write elsewhere (gpt-oss's expert stacks).
            landed = lands_in.get(t.name)
            params = landed or (layout.naming.parameter(t.name)[0],)
            reasons = [engine_refusals[p] for p in params if p in engine_refusals]
            if reasons:
                refused[t.name] = reasons[0]
            elif t.name in self.uncast:
                refused[t.name] = wider
            elif not landed and layout.modules is not None and params[0].rpartition(".")[0] not in layout.modules:
                refused[t.name] = elsewhere
        shapes = {name: tuple(spec.shape) for name, spec in self.gatherer.specs().items()}
        return patchable_tensors(plan.tensors, plan.targets, shapes, refused)

    def _sparse_tracker(
        self, plan: SyncPlan, found: tuple[frozenset[str], dict[str, str]] | None
    ) -> SparseTracker | None:
        """The sparse tracker of this plan (every rank, from rank 0's findings); None when nothing can be patched."""
        assert found is not None
        patchable, why = found
        if why:
            reasons: dict[str, list[str]] = {}
            for name, reason in why.items():
                reasons.setdefault(reason, []).append(name)
            for reason, names in reasons.items():
                logger.warning(
                    "weight sync: sparse syncs send %s whole: %s",
                    "every tensor" if names == ["*"] else f"{len(names)} tensor(s) ({', '.join(names[:4])}"
                    f"{' ...' if len(names) > 4 else ''})",
                    reason,
                )
        if not patchable:
            return None
        tracker = SparseTracker(
            plan.tensors,
            patchable,
            self.gatherer,
            self.writer.engine_dtype,
            max_density=self.config.sparse_max_density,
            to_all=self.writer.engine_per_rank,
        )
        logger.info("weight sync: sparse syncs for %d of %d tensors", len(patchable), len(plan.tensors))
        return tracker

    def _selection(self, plan: SyncPlan) -> tuple[Selection, float, bool]:
        """What this sync sends, the same on every rank: everything, or (delta) what can have changed plus whatever
        skipped weight changed since it was last pushed. Returns it with the seconds the check took, and whether
        every rank's sparse snapshot holds what the engine holds (then the sync may send patches)."""
        if not self.config.delta:
            return Selection(True, None, plan.tensors), 0.0, False
        started = time.perf_counter()
        changed: list[str] = []
        error: Exception | None = None
        structure, primed = "", False
        replaced: str | None = None
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
                if self.meter.device.type == "cuda" and world_size() == 1 and tracker.watched:
                    # NOTE: measured on one H200 (docs/delta.md): with no all-gather to save, the check costs more
                    # than the copies a delta sync skips. Kept on: the default is the safe one everywhere.
                    logger.info(
                        "weight sync: one CUDA rank: a complete sync (SyncConfig(delta=False)) measured faster than a "
                        "checked delta sync here; delta syncs pay off with several ranks or a server (docs/delta.md)"
                    )
            primed = tracker.primed
            if primed and self._versioned is not None:
                replaced = self._versioned.replaced()
            if primed and self.config.delta_check:
                changed = tracker.changed(self._shards(tracker.watched))
            # NOTE: a stable digest (str hashes differ between processes).
            structure = hashlib.sha256("\n".join(sorted(trainable)).encode()).hexdigest()
        except Exception as e:
            error = e
        failure = own_failure("check", error)
        sparse_ready = self._sparse is not None and self._sparse.ready
        state = (structure, primed, changed, failure, sparse_ready, replaced)
        try:
            states = self.coordinator.exchange(state)
        except SyncError as e:
            e.engine = e.engine or self._unchanged()
            raise
        failures = [s[3] for s in states if s[3] is not None]  # type: ignore[index]
        if failures:
            # A writer that could not ask its engine (a server that does not answer) says what it holds.
            engine = error.engine if isinstance(error, SyncError) and error.engine is not None else self._unchanged()
            raise agreed_error(error, failures, engine)
        if len({s[0] for s in states}) > 1:  # type: ignore[index]
            raise SyncStageError(
                "The trainable parameters (requires_grad) differ between ranks; every rank must train the same ones "
                "(the ranks would gather different units). Nothing was sent."
            )
        seconds = time.perf_counter() - started
        tracker = self._delta
        assert tracker is not None
        found = [f"rank {r}: {s[5]}" for r, s in enumerate(states) if s[5]]  # type: ignore[index]
        if found:
            logger.warning("weight sync: this sync sends every weight whole: %s", "; ".join(found))
        if found or not all(s[1] for s in states):  # type: ignore[index]
            # NOTE: on every rank, whichever rank is not primed: a rank whose sparse snapshot survived would diff the
            # next sync against weights this complete sync replaced (`resync` may have been called on one rank).
            self.resync()
            return tracker.complete(), seconds, False
        union = sorted({name for s in states for name in s[2]})  # type: ignore[index]
        if union:
            logger.warning(
                "weight sync: %d skipped weight(s) changed since they were last pushed; sending them: %s",
                len(union),
                ", ".join(plan.targets.get(n, n) for n in union),
            )
        return tracker.select(union), seconds, all(s[4] for s in states)  # type: ignore[index]

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
        if not self.config.delta_check:
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

        def work() -> None:
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
                listed = ", ".join(bad)
                raise NonFiniteWeightsError(f"NaN or Inf in this rank's shard of {len(bad)} weight(s): {listed}")

        def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
            return NonFiniteWeightsError(
                f"The weight sync refused to push non-finite weights: {describe_failures(failures)}. Nothing was "
                "sent; the engine keeps the previous sync's weights. Training has diverged (look at the loss, the "
                "learning rate, gradient clipping) or a weight was written outside training.",
                failures=tuple(failures),
                engine=self._unchanged(),
            )

        self._agreed("check", work, failed)

    def _push(
        self,
        plan: SyncPlan,
        digests: EngineDigests | None,
        selection: Selection,
        sparse: SparseRound | None = None,
    ) -> tuple[EngineState | None, StreamPass]:
        """Hand the stream to the writer, finish this rank's share of the gathers whatever happened, then agree with
        every rank on the outcome before anyone goes on.

        NOTE: the gather inside the stream is a sequence of collectives that every rank runs, with a status round
        before each unit's all-gather and before each gathered unit is handed on (`Rounds`). When anything on this
        rank fails part-way (its gather work, the mapping, the merge, the cast, the engine, the transport), the
        writer stops consuming and this rank says so at the next round, where every rank stops; units handed on
        before it were gathered whole on every rank. Then all ranks agree on the outcome, on a group of their own and
        within `sync_timeout_s`, so a failure on any rank is raised on every rank and none blocks.

        With `sparse`, `selection` holds the tensors sent whole (its `gather` also the patched ones when `verify`
        needs their digests: they are gathered, hashed and not sent), and the patches are written after them.

        Returns:
            this rank's engine state (None on a rank that does not push), and the pass (its figures).
        """
        writer = self.writer
        rounds = Rounds(self.coordinator)
        if writer.pushes and selection.tensors != self._prepared:
            # Transports that announce tensors announce this sync's (a delta selection); local work, so a failure
            # stops every rank at the gather's first round.
            rounds.attempt("push", lambda: writer.prepare(selection.tensors))
            self._prepared = () if rounds.failed else selection.tensors
        copy = writer.retains_tensors and not self.gatherer.tensors_outlive_step
        run = self.stream.open(plan, rounds, select=selection.gather, copy=copy, digests=digests)
        engine: EngineState | None = None
        leftover = 0
        stream: Iterator[tuple[str, torch.Tensor]] = iter(run)
        if sparse is not None:
            stream = _only(stream, frozenset(t.name for t in selection.tensors))
        # A sparse sync whose every tensor travels as patches writes no stream (an empty reload would still touch
        # every layer).
        writes = writer.pushes and (sparse is None or bool(selection.tensors))
        try:
            if writer.pushes:
                rounds.attempt("push", lambda: fault_point("write"))  # the push starts
            if writer.pushes and not writes and not rounds.failed:
                try:
                    for _ in stream:
                        pass
                    engine = EngineState("current")
                except StreamInterrupted:
                    engine = EngineState("unchanged")
            elif writes and not rounds.failed:
                try:
                    writer.write(_faulted(stream))
                    engine = EngineState("current")
                except Exception as e:
                    engine = e.engine if isinstance(e, SyncError) and e.engine is not None else EngineState("undefined")
                    if not isinstance(e.__cause__, StreamInterrupted) and not isinstance(e, StreamInterrupted):
                        rounds.fail("push", e)  # the engine or the transport itself
            elif not writer.pushes:
                # A rank that does not push consumes the stream itself (its figures are then its own).
                try:
                    for _ in stream:
                        pass
                except StreamInterrupted:
                    pass  # recorded in `rounds`
            elif engine is None:
                engine = EngineState("unchanged")
            if writer.pushes and engine is not None and engine.current:
                # A writer that returned early leaves the rest, which is counted.
                try:
                    leftover = sum(1 for _ in stream)
                except StreamInterrupted:
                    pass
            run.drain()
        except SyncTimeoutError as e:
            e.engine = engine
            raise
        if rounds.error is None and leftover and writer.pushes:
            rounds.fail("push", IncompleteSyncError(f"{writer.kind} stopped {leftover} tensor(s) before the end"))
        if sparse is not None and sparse.patches and rounds.error is None and not rounds.stopped and writer.pushes:
            try:
                fault_point("write.patches")
                writer.write_patches(sparse.patches)
            except Exception as e:
                engine = e.engine if isinstance(e, SyncError) and e.engine is not None else _unpatched(selection)
                rounds.fail("push", e)
        if rounds.error is None and not rounds.stopped and writer.pushes:
            try:
                fault_point("write.finish")
                writer.finish()
                if self._versioned is not None:
                    self._versioned.stamp(self._stamps.next())
            except Exception as e:
                rounds.fail("push", e)
        try:
            failures = self.coordinator.agree_on(rounds.stage or "push", rounds.error)
        except SyncError as e:
            e.engine = e.engine or engine
            raise
        if failures:
            raise agreed_error(rounds.error, failures, engine)
        return engine, run

    def _verify(self, digests: EngineDigests | None, pushed: EngineState | None) -> VerifyResult:
        """Compare the engine's own digests with what this rank sent (`digests`; None on a rank that does not push,
        which takes part in the agreement only); agreed on every rank. `pushed`: this rank's engine state after the
        push (what it still holds unless its digests differ)."""

        def work() -> VerifyResult:
            if digests is None:
                return VerifyResult()
            fault_point("verify")
            replicas, sharded = self.writer.engine_digests()
            result = digests.compare(replicas, sharded=sharded)
            if result.failed:
                raise VerifyError(result.describe())
            return result

        def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
            engine = pushed
            if isinstance(error, VerifyError):  # the weights named in its message differ from what was sent
                engine = EngineState("undefined", note="the engine's weights differ from what was sent")
            return agreed_error(error, failures, engine)

        return self._agreed("verify", work, failed)

    def _sparse_round(self, selection: Selection) -> SparseRound:
        """Diff every rank's pieces against its snapshot (local work, agreed), then count, decide and gather the
        patches (collectives on every rank)."""
        tracker, delta = self._sparse, self._delta
        assert tracker is not None and delta is not None

        def work() -> dict[str, Patch]:
            fault_point("sparse.diff")
            return tracker.diff(selection.tensors)

        local = self._agreed("patch", work, lambda error, failures: agreed_error(error, failures, self._unchanged()))
        rounds = Rounds(self.coordinator)
        try:
            sparse = tracker.round(selection.tensors, local, delta, rounds)
            failures = self.coordinator.agree_on(rounds.stage or "patch", rounds.error)
        except SyncError as e:
            e.engine = e.engine or self._unchanged()
            raise
        if failures:
            raise agreed_error(rounds.error, failures, self._unchanged())
        assert sparse is not None
        return sparse

    def _whole(self, selection: Selection, sparse: SparseRound) -> Selection:
        """The part of a sparse sync sent whole; with `verify`, the patched tensors are gathered too (their digests)."""
        tensors = sparse.dense
        gathered = tensors if not self.config.verify else selection.tensors
        return Selection(
            False,
            frozenset(s for t in gathered for s in t.sources),
            tensors,
            selection.skipped,
            selection.changed,
        )

    def _keep_snapshot(self, sparse: SparseRound | None, whole: bool) -> float:
        """After a successful push: the snapshot holds what was pushed (a sparse sync's diff already holds it; a
        dense sync takes it, unless backing off). Returns the seconds it took. A failure here is local: the next
        sync's agreement sees this rank not ready, and every rank goes dense."""
        tracker = self._sparse
        if tracker is None:
            return 0.0
        started = time.perf_counter()
        if sparse is not None:
            tracker.settle(sparse)
        elif (whole and tracker.dense_left == 0) or (not tracker.ready and tracker.after_dense()):
            try:
                tracker.take()
                logger.info("weight sync: sparse snapshot of this rank: %.1f MB", tracker.nbytes / 1e6)
            except Exception as e:  # noqa: BLE001 - local; see the docstring
                logger.warning("weight sync: could not take the sparse snapshot (%s); the next sync is dense", e)
                tracker.forget()
        return time.perf_counter() - started

    def resync(self) -> None:
        """Make the next sync complete (and dense): after the engine's weights were replaced outside this sync (a
        restarted engine, a checkpoint loaded into it), when what it holds can no longer be assumed."""
        if self._delta is not None:
            self._delta.forget()
        if self._sparse is not None:
            self._sparse.forget()
        if self._digests is not None:
            self._digests.forget()

    def sync(self, *, whole: bool = False) -> SyncReport:
        """Gather, map, cast and push every parameter once; every rank must call it (it runs collectives).

        Args:
            whole: send no patches this time (`SyncConfig.sparse`), every selected tensor whole; the snapshot is
                taken again afterwards, so later syncs go on as before (the same on every rank).

        Raises:
            SyncError: on every rank when any rank failed (see `_push`); `NonFiniteWeightsError` before anything is
                sent with `check_finite`; `VerifyError` with `verify` when the engine differs from what was sent;
                `SyncTimeoutError` when a rank does not arrive in time.
        """
        self.coordinator.reopen()
        if self._bounded is not None:
            self._bounded.bound(time.monotonic() + _writer_budget(self.config.sync_timeout_s))
        try:
            plan = self.plan()
            if self.config.check_finite:
                self._check_finite(plan)
            selection, check_seconds, sparse_ready = self._selection(plan)
        except SyncError:
            self.resync()  # as after any failed sync: the next one is complete (a restarted engine's included)
            raise
        digests = self._digests
        if digests is not None:
            digests.reset()
        self.meter.start()
        start = time.perf_counter()
        sparse: SparseRound | None = None
        sent = selection
        patch_seconds = 0.0
        try:
            if sparse_ready and not selection.complete and not whole:
                sparse = self._sparse_round(selection)
                sent = self._whole(selection, sparse)
                patch_seconds = time.perf_counter() - start
            pushed, run = self._push(plan, digests, sent, sparse)
            if self.meter.device.type == "cuda":
                torch.cuda.synchronize(self.meter.device)
            seconds = time.perf_counter() - start
            verified: VerifyResult | None = None
            verify_seconds = 0.0
            if self.config.verify:
                started = time.perf_counter()
                verified = self._verify(digests, pushed)
                verify_seconds = time.perf_counter() - started + (digests.seconds if digests is not None else 0.0)
                if verified.unverifiable:
                    logger.warning("weight sync: %s", verified.describe_unverifiable())
        except SyncError:
            self.resync()  # the engine may hold anything the failure left: the next sync is complete
            raise
        started = time.perf_counter()
        self._record(selection)
        check_seconds += time.perf_counter() - started
        snapshot_seconds = self._keep_snapshot(sparse, whole)
        return SyncReport(
            seconds=seconds,
            bytes=run.bytes,
            tensors=run.tensors,
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
            sparse=sparse is not None,
            patched_tensors=sparse.patched_tensors if sparse is not None else 0,
            diffed_elements=sparse.diffed_elements if sparse is not None else 0,
            changed_elements=sparse.changed_elements if sparse is not None else 0,
            patched_elements=sparse.patched_elements if sparse is not None else 0,
            patch_bytes=sparse.wire_bytes if sparse is not None else 0,
            snapshot_bytes=self._sparse.nbytes if self._sparse is not None else 0,
            snapshot_seconds=snapshot_seconds,
            patch_seconds=patch_seconds,
        )


def _unpatched(whole: Selection) -> EngineState:
    """The engine after a sparse sync whose patches failed without the writer's account: the tensors sent whole
    hold their new values, the patched ones their previous or new ones (patches are written element by element)."""
    if not whole.tensors:
        return EngineState("unchanged", note="the sync's patches were not written")
    return EngineState("mixed", note="the tensors sent whole hold their new values, the patched ones old or new ones")


def _writer_budget(sync_timeout_s: float) -> float:
    """How long a writer's own waits may take in one sync: the sync's bound, less a margin in which the ranks still
    agree before any of them gives up on the others (they wait `sync_timeout_s` at each status round)."""
    return sync_timeout_s - min(2.0, 0.1 * sync_timeout_s)


def _only(stream: Iterator[tuple[str, torch.Tensor]], names: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `stream` named in `names` (the rest is consumed, for its digests, and not sent)."""
    for name, tensor in stream:
        if name in names:
            yield name, tensor


def _faulted(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as the writer takes it, with the `write` fault point at every tensor."""
    for name, tensor in stream:
        fault_point("write", name=name)
        yield name, tensor
