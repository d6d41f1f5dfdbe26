"""The sparse part of a sync (`SyncConfig(sparse=True)`): which planned tensors may travel as patches, the snapshot
of what the engine holds for them (`fsdp_sync.sync.snapshot`), and one round: diff, count, decide, gather.

Decisions, the same on every rank (they decide which collectives run):
- At plan time, *patchable*: a floating tensor that the layout passes through unchanged (one trainer source, same
  name and shape: no fused experts, no conversion), with no PEFT merge, whose engine parameter can be written in
  place (`EngineWriter.patch_refusals`: not quantized, not packed away).
- Each round, *whole instead*: an engine module whose changed fraction (over its patchable tensors) is over
  `SyncConfig.sparse_max_density` (its patches would cost more than it), or one of whose new values is NaN (vLLM's
  patch loader reads NaN as "unchanged"); with the tensors that are not patchable, widened to every tensor of their
  engine modules (`DeltaTracker.widen`).

Exactness: the snapshot is what was pushed. The diff replaces it with the new values (those the patches and the
dense part send); it is valid again only after the push succeeded (`commit`), and `forget` after any failure makes
the next sync dense (the delta tracker makes it complete), which takes the snapshot again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from fsdp_sync.compat.engine_api import EngineLayout
from fsdp_sync.compat.manifest import PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch

from ..distributed import Coordinator, Rounds, agreed
from ..errors import EngineState, SyncError, agreed_error
from ..faults import fault_point
from ..patch_codec import segment_sizes
from ..gather.base import Gatherer
from ..writers.base import PatchWriter
from .delta import DeltaPolicy, DeltaTracker, EngineGroups
from ..report import Figures, SparseFigures
from .select import Payload, Selection, Settled
from .stream import SyncPlan
from .patches import (
    Counts,
    Packed,
    Patch,
    SparseRound,
    exchange_counts,
    exchange_patches,
    local_counts,
    pack_patches,
    unpack_patches,
)
from .snapshot import Snapshot

__all__ = ["BACKOFF_SYNCS", "SparsePolicy", "SparseTracker", "patchable_tensors"]

logger = logging.getLogger(__name__)

# After a sparse sync that sent most of what it diffed whole (the weights change faster than patches pay), this many
# syncs are dense without a diff (and without a snapshot to keep) before sparse is tried again: at learning rate
# 1e-5 a sparse sync that ends whole costs 1.3-1.4x a dense one (the diff comes on top; benchmarks/sparse_sync.py).
BACKOFF_SYNCS = 4


def patchable_tensors(
    tensors: Sequence[PlannedTensor],
    targets: dict[str, str],
    trainer_shapes: dict[str, tuple[int, ...]],
    refused: dict[str, str],
) -> tuple[frozenset[str], dict[str, str]]:
    """The planned tensors that can travel as patches (checkpoint names), and why each other one cannot.

    Args:
        tensors: the plan's tensors.
        targets: trainer name -> checkpoint name before the layout conversion (`SyncPlan.targets`).
        trainer_shapes: trainer name -> full shape.
        refused: checkpoint name -> why the engine cannot take a patch of it in place.
    """
    ok: set[str] = set()
    why: dict[str, str] = {}
    for t in tensors:
        if not t.spec.dtype.is_floating_point:
            why[t.name] = f"not floating point ({t.spec.dtype})"
        elif len(t.sources) != 1 or targets.get(t.sources[0]) != t.name:
            why[t.name] = "its layout is converted on the way (several trainer tensors, or renamed)"
        elif tuple(trainer_shapes.get(t.sources[0], ())) != tuple(t.spec.shape):
            why[t.name] = "its layout is converted on the way (a different shape)"
        elif t.name in refused:
            why[t.name] = f"the engine cannot patch it in place: {refused[t.name]}"
        else:
            ok.add(t.name)
    return frozenset(ok), why


class SparseTracker:
    """The snapshot of the patchable tensors and the round that diffs against it.

    Args:
        tensors: the plan's tensors, in stream order.
        patchable: checkpoint names of the tensors that may travel as patches.
        gatherer: gives this rank's pieces.
        dtype: the engine dtype (floating tensors are compared in it).
        max_density: above this changed fraction an engine module goes whole.
        to_all: every rank receives the patches (colocate), else rank 0 only (server mode).
    """

    def __init__(
        self,
        tensors: Sequence[PlannedTensor],
        patchable: frozenset[str],
        gatherer: Gatherer,
        dtype: torch.dtype | None,
        *,
        max_density: float,
        to_all: bool,
    ) -> None:
        self.tensors = {t.name: t for t in tensors if t.name in patchable}
        self.source = {t.sources[0]: t.name for t in self.tensors.values()}
        self.gatherer = gatherer
        self.dtype = dtype
        self.max_density = max_density
        self.to_all = to_all
        self.snapshot = Snapshot(dtype)
        self.dense_left = 0

    @property
    def ready(self) -> bool:
        """The snapshot holds what the engine holds: the next sync may be sparse (agreed between ranks first)."""
        return self.snapshot.valid

    def settle(self, done: SparseRound) -> None:
        """After a sparse sync's push succeeded: keep the snapshot, or back off when most of it went whole (the same
        decision on every rank: it reads only agreed figures)."""
        if done.patched_share >= 0.5:
            self.snapshot.commit()
            return
        logger.info(
            "weight sync: %.0f%% of the weights went whole (changed fraction %.1f%% > sparse_max_density); the next "
            "%d syncs are dense, then sparse is tried again",
            100 * (1 - done.patched_share),
            100 * done.changed_elements / max(done.diffed_elements, 1),
            BACKOFF_SYNCS,
        )
        self.snapshot.forget()
        self.dense_left = BACKOFF_SYNCS

    def after_dense(self) -> bool:
        """After a dense sync succeeded: whether to take the snapshot now (not while backing off, but at its last
        dense sync, so that the next one may be sparse)."""
        if self.dense_left:
            self.dense_left -= 1
            return self.dense_left == 0
        return True

    def take(self) -> None:
        """After a dense sync of every patchable tensor succeeded: hold this rank's pieces of them as pushed."""
        self.snapshot.take(self.gatherer.local_pieces(sorted(self.source)))
        self.snapshot.commit()

    def forget(self) -> None:
        self.snapshot.forget()

    def diff(self, selected: Sequence[PlannedTensor]) -> dict[str, Patch]:
        """This rank's patches of the selected patchable tensors (by checkpoint name); local work, no collective."""
        sources = [t.sources[0] for t in selected if t.name in self.tensors]
        patches = self.snapshot.diff(self.gatherer.local_pieces(sources))
        return {self.source[name]: patch for name, patch in patches.items()}

    def round(
        self,
        selected: Sequence[PlannedTensor],
        local: dict[str, Patch],
        delta: DeltaTracker,
        rounds: Rounds,
        coordinator: Coordinator,
    ) -> SparseRound | None:
        """Count every rank's changes, decide what goes whole, gather the rest as patches (collectives: every rank).

        Failure model: a status round before the counts and another before the patch gathers, so a rank that fails
        in its local work (its counts; the decision and its encoded patches) says so before any rank enters those
        collectives, and every rank stops together (the pipeline's agreement then raises on every rank). Decoding
        the gathered patches comes after the last collective.

        Args:
            selected: the tensors this sync sends (the delta selection), in stream order.
            local: this rank's patches (`diff`).
            delta: the delta tracker, whose engine-module grouping widens what goes whole.
            rounds: this sync's status rounds (a failure here is recorded in it, stage `patch`).
            coordinator: the sync's own groups, on which the counts and the patches travel (a rank whose collective
                raises there aborts them: every rank raises a `SyncError` at once).

        Returns:
            the round, or None when a rank failed (`rounds` says which).
        """
        names = [t.name for t in selected if t.name in self.tensors]

        def count() -> torch.Tensor:
            fault_point("sparse.count")
            return local_counts(names, local)

        mine = rounds.attempt("patch", count)
        if not rounds.go_on():
            return None
        assert mine is not None
        # NOTE: the counts and the patches travel on the sync's own group, not the trainer's: a rank
        # whose collective raises there aborts it for every rank, which torch cannot do inside the training group.
        counts = coordinator.run("patch.counts", lambda group: exchange_counts(names, mine, group=group))

        def pack() -> tuple[SparseRound, Packed]:
            fault_point("sparse.pack")
            return self._decide(selected, names, counts, local, delta)

        decided = rounds.attempt("patch", pack)
        if not rounds.go_on():
            return None
        assert decided is not None
        plan, packed = decided
        exchanged = coordinator.run(
            "patch.gather", lambda group: exchange_patches(packed, to_all=self.to_all, group=group)
        )
        receive = self.to_all or not dist.is_initialized() or dist.get_rank() == 0

        def unpack() -> SparseRound:
            if receive:
                fault_point("sparse.unpack")
            joined = unpack_patches(packed, exchanged, receive=receive)
            patches = tuple(
                EnginePatch(n, tuple(self.tensors[n].spec.shape), dtype, p.indices, p.values)
                for n, dtype in zip(packed.names, packed.dtypes, strict=True)
                if (p := joined.patches.get(n)) is not None
            )
            return replace(plan, patches=patches, wire_bytes=joined.wire_bytes)

        return rounds.attempt("patch", unpack)

    def _decide(
        self,
        selected: Sequence[PlannedTensor],
        names: list[str],
        counts: Counts,
        local: dict[str, Patch],
        delta: DeltaTracker,
    ) -> tuple[SparseRound, Packed]:
        """What goes whole (the same on every rank: from the agreed counts) and this rank's patches of the rest,
        encoded; the round's figures (its patches and bytes are filled in once gathered)."""
        totals = counts.totals
        numels = {n: math.prod(self.tensors[n].spec.shape) for n in names}
        dense_seed: set[str] = {t.name for t in selected if t.name not in self.tensors}
        # NOTE: decided per engine module, which goes whole or not as one (the layer-wise reload needs all of a
        # module): a zero-initialised bias whose every bf16 value moves makes no difference beside its module's
        # weights, so the changed fraction is the module's.
        by_module: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            by_module.setdefault(delta.groups.group(n), []).append(i)
        for members in by_module.values():
            size = sum(numels[names[i]] for i in members)
            nan = any(counts.nan[i] for i in members)
            if nan or (size and sum(totals[i] for i in members) / size > self.max_density):
                dense_seed.update(names[i] for i in members)
        whole = delta.widen(dense_seed) if dense_seed else frozenset()
        sparse_names = [n for n in names if n not in whole]
        dtypes = [self._wire_dtype(self.tensors[n]) for n in sparse_names]
        sizes = [numels[n] for n in sparse_names]
        patched = counts.subset(sparse_names)
        packed = pack_patches(sparse_names, local, dtypes, sizes, patched)
        plan = SparseRound(
            dense=tuple(t for t in selected if t.name in whole),
            patches=(),
            patched_tensors=len(sparse_names),
            diffed_elements=sum(numels.values()),
            changed_elements=sum(totals),
            patched_elements=sum(numels[n] for n in sparse_names),
            wire_bytes=0,
            encoded_bytes=sum(
                sum(segment_sizes(numel, count, dtype.itemsize))
                for numel, count, dtype in zip(sizes, patched.totals, dtypes, strict=True)
                if count  # a tensor without a change has no patch
            ),
        )
        return plan, packed

    def _wire_dtype(self, t: PlannedTensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.spec.dtype.is_floating_point else t.spec.dtype

    @property
    def nbytes(self) -> int:
        """This rank's snapshot, in bytes."""
        return self.snapshot.nbytes


# Why a tensor travels whole: reasons found at plan time, by what the engine says of its parameters.
_WIDER = "the engine keeps it wider than its dtype (patches carry engine-dtype values)"
_ELSEWHERE = (
    "the engine has no parameter where its name says (its loader renames or restacks it, as gpt-oss's expert stacks), "
    "so where a patch lands is not known"
)
_PEFT = "PEFT adapters are merged into their base weights on the way (delta syncs already skip what cannot change)"


class SparsePolicy:
    """`SyncConfig(sparse=True)`, over delta: a delta sync whose every rank holds a valid snapshot sends the
    engine-dtype elements that changed as patches, and what cannot travel as patches whole.

    Args:
        delta: the delta policy this one builds on (what can have changed, proven).
        gatherer: this rank's pieces, the trainer's shapes.
        coordinator: the control plane (the agreement on the local diff, the round's own).
        writer: the engine's patch writer (None: this transport writes none; every sync is dense).
        engine_dtype: what patches carry.
        engine_per_rank: every rank writes its own engine (colocate: every rank receives the patches).
        max_density: `SyncConfig.sparse_max_density`.
        gather_patched: the patched tensors are gathered whole too (`verify` needs their digests) and not sent.
        peft: the model merges PEFT adapters on the way (then nothing travels as patches).
        uncast: checkpoint names the engine keeps wider than its dtype.
        unchanged: what this rank's engine holds when nothing was sent.
    """

    needs_layout = True

    def __init__(
        self,
        delta: DeltaPolicy,
        gatherer: Gatherer,
        coordinator: Coordinator,
        *,
        writer: PatchWriter | None,
        engine_dtype: torch.dtype | None,
        engine_per_rank: bool,
        max_density: float,
        gather_patched: bool,
        peft: bool,
        uncast: frozenset[str],
        unchanged: Callable[[], EngineState | None],
    ) -> None:
        self.delta = delta
        self.gatherer = gatherer
        self.coordinator = coordinator
        self.writer = writer
        self.engine_dtype = engine_dtype
        self.engine_per_rank = engine_per_rank
        self.max_density = max_density
        self.gather_patched = gather_patched
        self.peft = peft
        self.uncast = uncast
        self.unchanged = unchanged
        self.tracker: SparseTracker | None = None
        self._whole_next = self._retake = False

    def survey(self, plan: SyncPlan, layout: EngineLayout | None) -> tuple[EngineGroups, tuple[frozenset[str], dict[str, str]]]:
        return self.delta.survey(plan, layout), self._patchable(plan, layout)

    def _patchable(self, plan: SyncPlan, layout: EngineLayout | None) -> tuple[frozenset[str], dict[str, str]]:
        """Which planned tensors may travel as patches, and why the others cannot (rank 0, at plan time)."""
        assert layout is not None
        refusal = "this transport writes no patches" if self.writer is None else self.writer.sparse_refusal()
        if refusal is None and self.peft:
            refusal = _PEFT
        if refusal is not None:
            return frozenset(), {"*": refusal}
        assert self.writer is not None
        engine_refusals = self.writer.patch_refusals()
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
                refused[t.name] = _WIDER
            elif not landed and layout.modules is not None and params[0].rpartition(".")[0] not in layout.modules:
                refused[t.name] = _ELSEWHERE
        shapes = {name: tuple(spec.shape) for name, spec in self.gatherer.specs().items()}
        return patchable_tensors(plan.tensors, plan.targets, shapes, refused)

    def adopt(self, plan: SyncPlan, found: tuple[EngineGroups, tuple[frozenset[str], dict[str, str]]]) -> None:
        """The tracker of this plan (every rank, from rank 0's findings); none when nothing can be patched."""
        groups, (patchable, why) = found
        self.delta.adopt(plan, groups)
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
        self.tracker = None
        if patchable:
            self.tracker = SparseTracker(
                plan.tensors,
                patchable,
                self.gatherer,
                self.engine_dtype,
                max_density=self.max_density,
                to_all=self.engine_per_rank,
            )
            logger.info("weight sync: sparse syncs for %d of %d tensors", len(patchable), len(plan.tensors))

    def whole_next(self) -> None:
        """Send the next sync's selection whole, without patches (the same on every rank; the snapshot is taken
        again afterwards, so later syncs go on as before): what a side-by-side benchmark of the two needs."""
        self._whole_next = True

    def choose(self, plan: SyncPlan) -> Payload:
        tracker = self.tracker
        payload, ready = self.delta.decide(plan, ready=tracker is not None and tracker.ready)
        if payload.fresh and tracker is not None:
            tracker.forget()
        # NOTE: a sync sent whole on request leaves the snapshot behind what the engine holds: taken again after it.
        self._retake, self._whole_next = self._whole_next, False
        if tracker is None or not ready or payload.selection.complete or self._retake:
            return payload
        started = time.perf_counter()
        selection = payload.selection
        done = self._round(tracker, selection)
        sent = done.dense if not self.gather_patched else selection.tensors
        return replace(
            payload,
            whole=done.dense,
            gather=frozenset(s for t in sent for s in t.sources),
            patches=done.patches,
            detail=done,
            patch_seconds=time.perf_counter() - started,
        )

    def _round(self, tracker: SparseTracker, selection: Selection) -> SparseRound:
        """Diff every rank's pieces against its snapshot (local work, agreed), then count, decide and gather the
        patches (collectives on every rank, with their own status rounds)."""

        def diff() -> dict[str, Patch]:
            fault_point("sparse.diff")
            return tracker.diff(selection.tensors)

        local = agreed(self.coordinator, "patch", diff, lambda e, failures: agreed_error(e, failures, self.unchanged()))
        rounds = Rounds(self.coordinator)
        try:
            assert self.delta.tracker is not None
            done = tracker.round(selection.tensors, local, self.delta.tracker, rounds, self.coordinator)
            failures = self.coordinator.agree_on(rounds.stage or "patch", rounds.error)
        except SyncError as e:
            e.engine = e.engine or self.unchanged()
            raise
        if failures:
            raise agreed_error(rounds.error, failures, self.unchanged())
        assert done is not None
        return done

    def settle(self, payload: Payload) -> Settled:
        """After a successful push: the snapshot holds what was pushed (a sparse sync's diff already holds it; a dense
        sync takes it, unless backing off). A failure here is local: the next sync's agreement sees this rank not
        ready, and every rank goes dense."""
        settled = self.delta.settle(payload)
        tracker = self.tracker
        if tracker is None:
            return settled
        started = time.perf_counter()
        if isinstance(payload.detail, SparseRound):
            tracker.settle(payload.detail)
        elif (self._retake and tracker.dense_left == 0) or (not tracker.ready and tracker.after_dense()):
            try:
                tracker.take()
                logger.info("weight sync: sparse snapshot of this rank: %.1f MB", tracker.nbytes / 1e6)
            except Exception as e:  # noqa: BLE001 - local; see the docstring
                logger.warning("weight sync: could not take the sparse snapshot (%s); the next sync is dense", e)
                tracker.forget()
        return replace(settled, snapshot_seconds=time.perf_counter() - started)

    def forget(self) -> None:
        self.delta.forget()
        if self.tracker is not None:
            self.tracker.forget()

    def report(self, payload: Payload, settled: Settled) -> tuple[Figures, ...]:
        done = payload.detail if isinstance(payload.detail, SparseRound) else None
        snapshot = self.tracker.nbytes if self.tracker is not None else 0
        sparse = SparseFigures(
            patched=done is not None,
            patched_tensors=done.patched_tensors if done is not None else 0,
            patched_elements=done.patched_elements if done is not None else 0,
            diffed_elements=done.diffed_elements if done is not None else 0,
            changed_elements=done.changed_elements if done is not None else 0,
            patch_bytes=done.wire_bytes if done is not None else 0,
            encoded_bytes=done.encoded_bytes if done is not None else 0,
            snapshot_bytes=snapshot,
            snapshot_seconds=settled.snapshot_seconds,
            patch_seconds=payload.patch_seconds,
        )
        return (*self.delta.report(payload, settled), sparse)
