"""Send only what can have changed (`SyncConfig(delta=True)`, the default), and prove every sync that the rest did not.

Why: with LoRA or frozen parts (embeddings, a vision tower, lower layers), most weights cannot change between syncs,
yet a complete sync gathers and pushes them all. After one complete sync, a delta sync sends the tensors that can
change (trainable parameters; for PEFT the base weights that adapters merge into, and `modules_to_save` copies),
each widened to whole engine modules, and skips the rest. Skipping is only worth having if it is never wrong, so:

- **Proof, every sync.** Each rank fingerprints its own shards of every skipped parameter (on its device, no gather)
  and compares them with the fingerprints taken when those values were last pushed; the ranks agree on the union of
  what changed with one small collective, and a changed skipped parameter is sent (and logged by name).
- **Whole engine modules.** vLLM's layer-wise reload processes a layer once all of its weights arrived; a layer that
  receives part of its weights is processed from what it has at the end of the reload, the rest uninitialised
  (measured on vLLM 0.32: the v rows of a fused `qkv_proj` after a push of q_proj and k_proj alone; NaN in a fused
  MoE layer's `w2_weight` after a push of its experts' gate and up projections alone). So every checkpoint tensor
  that vLLM loads into the same module goes together: the engine model's `packed_modules_mapping` says which
  checkpoint modules one engine module fuses (`qkv_proj: [q_proj, k_proj, v_proj]`), and where the engine has no
  module at a checkpoint module's path, the indexed container it belongs to goes whole (every expert of
  `...mlp.experts.<i>.*`, which vLLM loads into one fused-experts module).
- **Complete when in doubt.** The first sync of a sync object, every sync after a failed one, and every sync after
  the trainable set changed (`requires_grad` flipped, adapters switched) are complete again.

The fingerprint of a tensor (`fsdp_sync.sync.fingerprint`) is computed where the tensor lives: the CRC-32 of its
bytes on the CPU, position-weighted integer sums of its bits on an accelerator (no copy to the host).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming
from fsdp_sync.compat.manifest import PlannedTensor

from ..distributed import Coordinator, own_failure, world_size
from ..errors import EngineState, SyncError, SyncStageError, agreed_error
from ..faults import fault_point
from ..gather.base import Gatherer
from ..kernels.runtime import HostReadback
from ..writers.base import VersionedWriter
from ..report import DeltaFigures
from .fingerprint import Fingerprinter
from .select import Payload, Selection, Settled
from .stream import SyncPlan

__all__ = ["DeltaPolicy", "DeltaTracker", "EngineGroups", "Selection", "nbytes"]

logger = logging.getLogger(__name__)


class EngineGroups:
    """Which checkpoint tensors vLLM loads into one engine module (a module that receives any must receive all).

    Args:
        naming: where vLLM loads each checkpoint tensor (the model's renaming and `packed_modules_mapping`).
        engine_modules: paths of the engine modules that own parameters (colocate: from the engine model; server:
            from the server's parameter names), or None where the engine does not list them (a server without
            `/weight_checker`, vLLM < 0.32): then every tensor of one decoder layer (the outermost indexed container
            of its name, `model.layers.3`) goes together, a superset of any engine module inside it.
    """

    def __init__(self, naming: EngineNaming, engine_modules: Iterable[str] | None) -> None:
        self._naming = naming
        self._by_layer = engine_modules is None
        self._modules = frozenset(engine_modules or ())
        # Every proper ancestor of an engine module: "does the engine have modules under this path" in one lookup.
        self._ancestors = frozenset(m.rsplit(".", k)[0] for m in self._modules for k in range(1, m.count(".") + 1))

    @classmethod
    def of(cls, layout: EngineLayout) -> EngineGroups:
        """The grouping of an engine, from what it says of its weights (`EngineWriter.engine_layout`)."""
        return cls(layout.naming, layout.modules)

    def group(self, name: str) -> str:
        """The engine module a checkpoint tensor is loaded into: its own, after renaming and fusing; where the
        engine has no module of that path, its parent module when the engine has modules under it (a fused module
        the mapping does not name is a sibling of its parts), else the indexed container it belongs to (fused
        experts: `...mlp.experts` over `...mlp.experts.<i>.gate_proj`, which vLLM loads into one module, e.g.
        `...mlp.experts.routed_experts`)."""
        module = self._naming.parameter(name)[0].rpartition(".")[0]
        if self._by_layer:
            segments = module.split(".")
            index = next((i for i, segment in enumerate(segments) if segment.isdigit()), None)
            return module if index is None else ".".join(segments[: index + 1])
        if module in self._modules or not self._modules:
            return module
        parent = module.rpartition(".")[0]
        if parent and self._has_modules_under(parent):
            return parent
        segments = module.split(".")
        for index in range(len(segments) - 1, 0, -1):
            if segments[index].isdigit():
                container = ".".join(segments[:index])
                if self._has_modules_under(container):
                    return container
        return module

    def _has_modules_under(self, prefix: str) -> bool:
        return prefix in self._ancestors


class DeltaTracker:
    """The delta plan of one model structure and the fingerprints of the weights it skips.

    Args:
        tensors: the planned tensors, in stream order.
        trainable: trainer names that can change between syncs (parameters with `requires_grad`).
        merge_targets: checkpoint names that PEFT adapters merge into.
        groups: the engine's module grouping.
    """

    def __init__(
        self,
        tensors: Sequence[PlannedTensor],
        trainable: frozenset[str],
        merge_targets: frozenset[str],
        groups: EngineGroups,
    ) -> None:
        self.tensors = tuple(tensors)
        self.groups = groups
        self.trainable = trainable
        by_group: dict[str, list[PlannedTensor]] = {}
        for t in self.tensors:
            by_group.setdefault(groups.group(t.name), []).append(t)
        self._by_group = by_group
        seeds = {t.name for t in self.tensors if t.name in merge_targets or set(t.sources) & trainable}
        self.always = self.widen(seeds)
        sent_sources = {s for t in self.tensors if t.name in self.always for s in t.sources}
        # Skipped and watched: the sources of every tensor not always sent (a source is never both).
        self.watched = tuple(sorted({s for t in self.tensors if t.name not in self.always for s in t.sources}
                                    - sent_sources))  # fmt: skip
        # The names fingerprinted at the last push, in order, with their fingerprints (one row each).
        self._reference: tuple[tuple[str, ...], torch.Tensor] | None = None
        self._fingerprints = Fingerprinter()
        self._readback = HostReadback()
        self._unchanged: Selection | None = None
        self._primed = False

    def widen(self, names: set[str]) -> frozenset[str]:
        """`names` widened to whole engine modules and to every output of the trainer tensors they come from,
        until nothing more is added."""
        sources_of = {t.name: set(t.sources) for t in self.tensors}
        outputs_of: dict[str, set[str]] = {}
        for t in self.tensors:
            for s in t.sources:
                outputs_of.setdefault(s, set()).add(t.name)
        result = set(names)
        while True:
            grown = {n for name in result for n in (t.name for t in self._by_group[self.groups.group(name)])}
            grown |= {o for name in grown for s in sources_of[name] for o in outputs_of[s]}
            if grown <= result:
                return frozenset(result)
            result |= grown

    @property
    def primed(self) -> bool:
        """Whether a complete sync succeeded since this plan was made (or since the last failure)."""
        return self._primed

    def mark_complete(self) -> None:
        self._primed = True

    def forget(self) -> None:
        """After a failed sync: the next one is complete (the engine may hold anything the failure left)."""
        self._reference = None
        self._primed = False

    def record(self, shards: Iterable[tuple[str, torch.Tensor]], only: Iterable[str] | None = None) -> None:
        """Fingerprint the watched weights (or `only` these) as they were just pushed."""
        names, prints = self._fingerprints(shards)
        if only is None or self._reference is None:
            self._reference = (tuple(names), prints)
            return
        held, reference = self._reference
        where = {n: i for i, n in enumerate(held)}
        fresh = {n: i for i, n in enumerate(names)}
        pairs = [(where[n], fresh[n]) for n in only if n in fresh and n in where]
        if pairs:
            reference = reference.clone()
            into, take = zip(*pairs, strict=True)
            reference[list(into)] = prints[list(take)].to(reference.device)
        added = [n for n in only if n in fresh and n not in where]
        if added:
            held = held + tuple(added)
            reference = torch.cat([reference, prints[[fresh[n] for n in added]].to(reference.device)])
        self._reference = (held, reference)

    def changed(self, shards: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Watched trainer names whose local shard differs from its fingerprint at the last push (this rank).

        NOTE: compared on the device, and read back once (a pinned copy of one flag per tensor): nothing waits for
        the device per tensor.
        """
        assert self._reference is not None, "record() at the complete sync before checking"
        names, now = self._fingerprints(shards)
        if not names:
            return []
        held, reference = self._reference
        if tuple(names) != held:
            where = {n: i for i, n in enumerate(held)}
            reference = reference[[where[n] for n in names]]
        differs = (now != reference.to(now.device)).any(dim=1)
        (flags,) = self._readback.read(differs)
        return [n for n, d in zip(names, flags.tolist(), strict=True) if d]

    def select(self, changed: Iterable[str]) -> Selection:
        """The delta selection: the always-sent tensors plus whatever the changed skipped weights widen to."""
        changed = tuple(sorted(changed))
        if not changed:  # the common case, the same every sync: made once (a walk over every tensor)
            if self._unchanged is None:
                self._unchanged = self._select(())
            return self._unchanged
        return self._select(changed)

    def _select(self, changed: tuple[str, ...]) -> Selection:
        extra = {t.name for t in self.tensors if set(t.sources) & set(changed)}
        sent = self.always | self.widen(extra) if extra else self.always
        tensors = tuple(t for t in self.tensors if t.name in sent)
        skipped = tuple(t for t in self.tensors if t.name not in sent)
        return Selection(False, frozenset(s for t in tensors for s in t.sources), tensors, skipped, changed)

    def complete(self) -> Selection:
        return Selection(True, None, self.tensors)


def nbytes(tensors: Iterable[PlannedTensor], engine_dtype: torch.dtype | None) -> int:
    """Bytes of planned tensors on the wire (floating tensors in the engine dtype)."""
    total = 0
    for t in tensors:
        dtype = engine_dtype if (engine_dtype is not None and t.spec.dtype.is_floating_point) else t.spec.dtype
        total += math.prod(t.spec.shape) * dtype.itemsize
    return total


class DeltaPolicy:
    """`SyncConfig(delta=True)`: after one complete sync, send what can have changed, and prove every sync that the
    rest did not (the fingerprints of every rank's shards of what is skipped, agreed between ranks).

    Args:
        gatherer: the trainer's gatherer (what is trainable, this rank's shards).
        coordinator: the sync's control plane (the agreement on what each rank found).
        check: fingerprint the skipped weights (`SyncConfig.delta_check`).
        merge_names: the trainer names PEFT adapters merge into (their base weights are sent with the adapters).
        versions: the pushing writer's weight versions (`VersionedWriter`), or None: a restarted or replaced engine
            makes the sync complete.
        unchanged: what this rank's engine holds when nothing was sent (None on a rank without an engine).
        device: where the trainer computes (one CUDA rank: logged once that complete syncs measured faster there).
        engine_dtype: the engine's dtype (the bytes a sync skipped, on the wire).
    """

    needs_layout = True

    def __init__(
        self,
        gatherer: Gatherer,
        coordinator: Coordinator,
        *,
        check: bool,
        merge_names: frozenset[str],
        versions: VersionedWriter | None,
        unchanged: Callable[[], EngineState | None],
        device: torch.device,
        engine_dtype: torch.dtype | None = None,
    ) -> None:
        self.gatherer = gatherer
        self.engine_dtype = engine_dtype
        self.coordinator = coordinator
        self.check = check
        self.merge_names = merge_names
        self.versions = versions
        self.unchanged = unchanged
        self.device = device
        self.groups: EngineGroups | None = None
        self.tracker: DeltaTracker | None = None

    def survey(self, plan: SyncPlan, layout: EngineLayout | None) -> EngineGroups:
        assert layout is not None
        return EngineGroups.of(layout)

    def adopt(self, plan: SyncPlan, found: EngineGroups) -> None:
        # NOTE: the selection decides which collectives run, so every rank must make the same one: the engine's
        # grouping is read where the engine is known (rank 0; in server mode only it talks to the server).
        self.groups = found

    def choose(self, plan: SyncPlan) -> Payload:
        return self.decide(plan)[0]

    def decide(self, plan: SyncPlan, *, ready: bool = False) -> tuple[Payload, bool]:
        """What this sync sends, and whether `ready` holds on every rank (a flag of the policy built on this one,
        agreed in the same exchange: the sparse snapshot's)."""
        started = time.perf_counter()
        changed: list[str] = []
        error: Exception | None = None
        structure, primed, replaced = "", False, None
        stage = "check"
        try:
            fault_point("check")
            trainable = self.gatherer.trainable()
            tracker = self.tracker
            if tracker is None or tracker.trainable != trainable:  # new, or the trainable set changed: complete first
                tracker = self.tracker = self._tracker(plan, trainable)
            primed = tracker.primed
            if primed and self.versions is not None:
                # NOTE: a request to the engine (a server), not a local check: its failure is said as such.
                stage = "version"
                replaced = self.versions.replaced()
                stage = "check"
            if primed and self.check:
                changed = tracker.changed(self.gatherer.local_shards(tracker.watched))
            # NOTE: a stable digest (str hashes differ between processes).
            structure = hashlib.sha256("\n".join(sorted(trainable)).encode()).hexdigest()
        except Exception as e:
            error = e
        state = (structure, primed, changed, own_failure(stage, error), ready, replaced)
        try:
            states = self.coordinator.exchange(state)
        except SyncError as e:
            e.engine = e.engine or self.unchanged()
            raise
        failures = [s[3] for s in states if s[3] is not None]
        if failures:
            # A writer that could not ask its engine (a server that does not answer) says what it holds.
            engine = error.engine if isinstance(error, SyncError) and error.engine is not None else self.unchanged()
            raise agreed_error(error, failures, engine)
        if len({s[0] for s in states}) > 1:
            raise SyncStageError(
                "The trainable parameters (requires_grad) differ between ranks; every rank must train the same ones "
                "(the ranks would gather different units). Nothing was sent."
            )
        seconds = time.perf_counter() - started
        tracker = self.tracker
        assert tracker is not None
        found = [f"rank {r}: {s[5]}" for r, s in enumerate(states) if s[5]]
        if found:
            logger.warning("weight sync: this sync sends every weight whole: %s", "; ".join(found))
        if found or not all(s[1] for s in states):
            # NOTE: on every rank, whichever rank is not primed: a rank whose policy state survived would choose the
            # next sync from weights this complete sync replaces (`resync` may have been called on one rank only).
            self.forget()
            selection = tracker.complete()
            return Payload(selection, selection.tensors, None, fresh=True, check_seconds=seconds), False
        union = sorted({name for s in states for name in s[2]})
        if union:
            logger.warning(
                "weight sync: %d skipped weight(s) changed since they were last pushed; sending them: %s",
                len(union),
                ", ".join(plan.targets.get(n, n) for n in union),
            )
        selection = tracker.select(union)
        payload = Payload(selection, selection.tensors, selection.gather, check_seconds=seconds)
        return payload, all(s[4] for s in states)

    def _tracker(self, plan: SyncPlan, trainable: frozenset[str]) -> DeltaTracker:
        assert self.groups is not None
        # NOTE: merge targets are the model's own names, the tracker's are checkpoint names; they differ where
        # transformers converts the layout at load (VLMs: `model.language_model.*` is `model.*` on disk).
        merged = frozenset(
            t.name for t in plan.tensors if any(plan.targets.get(s) in self.merge_names for s in t.sources)
        )
        tracker = DeltaTracker(plan.tensors, trainable, merged, self.groups)
        if self.device.type == "cuda" and world_size() == 1 and tracker.watched:
            # NOTE: measured on one H200 (docs/delta.md): with no all-gather to save, the check costs more than the
            # copies a delta sync skips. Kept on: the default is the safe one everywhere.
            logger.info(
                "weight sync: one CUDA rank: a complete sync (SyncConfig(delta=False)) measured faster than a checked "
                "delta sync here; delta syncs pay off with several ranks or a server (docs/delta.md)"
            )
        return tracker

    def settle(self, payload: Payload) -> Settled:
        """After a successful push: fingerprint what was skipped (complete) or the skipped weights that were sent."""
        tracker = self.tracker
        if tracker is None:
            return Settled()
        started = time.perf_counter()
        selection = payload.selection
        if selection.complete:
            tracker.mark_complete()
        if self.check:
            try:
                if selection.complete:
                    tracker.record(self.gatherer.local_shards(tracker.watched))
                elif selection.changed:
                    tracker.record(self.gatherer.local_shards(selection.changed), only=selection.changed)
            except Exception as e:  # local work: the next sync's agreement sees this rank unprimed; all go complete
                logger.warning("weight sync: could not fingerprint the skipped weights (%s); the next sync is complete", e)
                tracker.forget()
        return Settled(check_seconds=time.perf_counter() - started)

    def forget(self) -> None:
        if self.tracker is not None:
            self.tracker.forget()

    def report(self, payload: Payload, settled: Settled) -> tuple[DeltaFigures]:
        selection = payload.selection
        return (
            DeltaFigures(
                complete=selection.complete,
                skipped_tensors=len(selection.skipped),
                skipped_bytes=nbytes(selection.skipped, self.engine_dtype),
                changed_skipped=len(selection.changed),
                check_seconds=payload.check_seconds + settled.check_seconds,
            ),
        )
