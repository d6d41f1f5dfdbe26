"""The sparse part of a sync (`SyncConfig(sparse=True)`): which planned tensors may travel as patches, the snapshot
of what the engine holds for them, and one round: diff, count, decide, gather.

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
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fsdp_sync.compat.manifest import PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch

from .delta import DeltaTracker
from .distributed import Rounds
from .faults import fault_point
from .gather.base import Gatherer
from .sparse import (
    Counts,
    Packed,
    Patch,
    Snapshot,
    exchange_counts,
    exchange_patches,
    local_counts,
    pack_patches,
    unpack_patches,
)

__all__ = ["BACKOFF_SYNCS", "SparseRound", "SparseTracker", "patchable_tensors"]

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


@dataclass(frozen=True)
class SparseRound:
    """One sparse sync's plan and payload.

    Attributes:
        dense: the planned tensors sent whole this time, in stream order.
        patches: the patches, on the ranks that push (colocate: every rank; server mode: rank 0).
        patched_tensors: how many tensors travel as patches (on every rank).
        diffed_elements: the elements of every tensor diffed (patched or sent whole after the diff).
        changed_elements: the changed elements among them.
        patched_elements: the elements of the tensors sent as patches.
        wire_bytes: bytes of the patch collectives as one rank receives them.
    """

    dense: tuple[PlannedTensor, ...]
    patches: tuple[EnginePatch, ...]
    patched_tensors: int
    diffed_elements: int
    changed_elements: int
    patched_elements: int
    wire_bytes: int

    @property
    def patched_share(self) -> float:
        """Of the diffed elements, the share sent as patches (not whole)."""
        return self.patched_elements / self.diffed_elements if self.diffed_elements else 1.0


class SparseTracker:
    """The snapshot of the patchable tensors and the round that diffs against it.

    Args:
        tensors: the plan's tensors, in stream order.
        patchable: checkpoint names of the tensors that may travel as patches.
        gatherer: gives this rank's pieces.
        dtype: the engine dtype (floating tensors are compared in it).
        max_density: above this changed fraction an engine module goes whole.
        to_all: every rank receives the patches (colocate), else rank 0 only (server mode).
        group: the trainer's process group.
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
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.tensors = {t.name: t for t in tensors if t.name in patchable}
        self.source = {t.sources[0]: t.name for t in self.tensors.values()}
        self.gatherer = gatherer
        self.dtype = dtype
        self.max_density = max_density
        self.to_all = to_all
        self.group = group
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
        self, selected: Sequence[PlannedTensor], local: dict[str, Patch], delta: DeltaTracker, rounds: Rounds
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
        counts = exchange_counts(names, mine, group=self.group)

        def pack() -> tuple[SparseRound, Packed]:
            fault_point("sparse.pack")
            return self._decide(selected, names, counts, local, delta)

        decided = rounds.attempt("patch", pack)
        if not rounds.go_on():
            return None
        assert decided is not None
        plan, packed = decided
        exchanged = exchange_patches(packed, to_all=self.to_all, group=self.group)
        receive = self.to_all or not dist.is_initialized() or dist.get_rank(self.group) == 0

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
        packed = pack_patches(sparse_names, local, dtypes, sizes, counts.subset(sparse_names))
        plan = SparseRound(
            dense=tuple(t for t in selected if t.name in whole),
            patches=(),
            patched_tensors=len(sparse_names),
            diffed_elements=sum(numels.values()),
            changed_elements=sum(totals),
            patched_elements=sum(numels[n] for n in sparse_names),
            wire_bytes=0,
        )
        return plan, packed

    def _wire_dtype(self, t: PlannedTensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.spec.dtype.is_floating_point else t.spec.dtype

    @property
    def nbytes(self) -> int:
        """This rank's snapshot, in bytes."""
        return self.snapshot.nbytes
