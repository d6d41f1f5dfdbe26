"""One sync as data flowing: gatherer -> checkpoint names -> manifest check (once) -> cast -> engine writer -> report."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fsdp_sync.compat.layout import IdentityLayout, Layout
from fsdp_sync.compat.manifest import ManifestError, PlannedTensor, TensorSpec, check_plan
from fsdp_sync.compat.names import Dropped, NameRules, canonical_name

from .distributed import stop_together
from .gather.base import Gatherer
from .memory import MemoryMeter
from .peft_merge import PeftMerge
from .report import SyncReport
from .writers.base import EngineWriter

__all__ = ["IncompleteSyncError", "RemoteSyncError", "SyncPlan", "WeightSync", "build_plan"]

logger = logging.getLogger(__name__)


class IncompleteSyncError(RuntimeError):
    """The gather produced a different set of parameters than planned (the model changed under the sync)."""


class RemoteSyncError(RuntimeError):
    """The sync failed on another rank; raised on this rank so that every rank stops at the same point."""


@dataclass(frozen=True)
class SyncPlan:
    """What every sync of one model structure sends; computed once from metadata.

    Attributes:
        tensors: the tensors pushed, by checkpoint name, with full specs and trainer sources.
        targets: trainer name -> checkpoint name, for every trainer parameter that is sent.
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
    ) -> None:
        self.gatherer = gatherer
        self.writer = writer
        self.rules = rules or NameRules()
        self.layout: Layout = layout or IdentityLayout()
        self.merge = merge
        self.backend = backend
        self.check_manifest = check_manifest
        self.meter = MemoryMeter(torch.device(device))
        self._plan: SyncPlan | None = None

    @property
    def checked_plan(self) -> SyncPlan | None:
        """The plan once it has passed its check (first sync), else None; reading it runs no collective."""
        return self._plan

    def plan(self) -> SyncPlan:
        """Map every trainer parameter to its checkpoint name and check the result against the engine (cached).

        Raises:
            ManifestError: on any rank, for any mismatch; raised on every rank so that none enters a collective.
        """
        if self._plan is not None:
            return self._plan
        error: Exception | None = None
        plan: SyncPlan | None = None
        try:
            plan = build_plan(self.gatherer, self.rules, self.layout)
            if self.check_manifest and self.writer.pushes:
                check_plan(plan.tensors, self.writer.manifest())
        except (ManifestError, ValueError, FileNotFoundError) as e:
            error = e
        stop_together(error, "plan", ManifestError, "Nothing was sent.")
        assert plan is not None
        for d in plan.dropped:
            logger.info("weight sync: not sending %s: %s", d.name, d.reason)
        self.writer.prepare(plan.tensors)
        self._plan = plan
        return plan

    def _stream(
        self, plan: SyncPlan, counts: dict[str, int], *, copy_all: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under checkpoint names, cast to the engine dtype once; copied only where the writer keeps
        references and the gatherer frees storage at the next unit, or always with `copy_all` (a caller that keeps
        the last tensor while the next unit is gathered then holds that tensor, not its whole unit)."""
        dtype = self.writer.engine_dtype
        copy = copy_all or (self.writer.retains_tensors and not self.gatherer.tensors_outlive_step)
        dropped = {d.name for d in plan.dropped}
        merge_names = self.merge.names if self.merge is not None else frozenset()
        seen: set[str] = set()
        for trainer_name, tensor in self.gatherer.iter_full(self.meter):
            target = plan.targets.get(trainer_name)
            if target is None:
                if trainer_name in dropped:
                    continue
                raise IncompleteSyncError(
                    f"Parameter {trainer_name!r} was gathered but is not in the sync plan; the model structure changed "
                    "after the first sync. Rebuild the sync (the mixin does this when the model object changes)."
                )
            seen.add(trainer_name)
            fresh = False
            if self.merge is not None and target in merge_names:
                tensor = self.merge.apply(target, tensor)
                self.meter.hold_until_freed(tensor)
                fresh = True
            for name, out in self.layout.convert(target, tensor):
                cast_to = dtype if (dtype is not None and out.is_floating_point()) else out.dtype
                owned = out.to(dtype=cast_to, copy=copy and not fresh)
                if owned is not out:
                    self.meter.hold_until_freed(owned)
                counts["bytes"] += owned.numel() * owned.element_size()
                counts["tensors"] += 1
                yield name, owned
                # NOTE: drop this frame's references before the gatherer is asked for the next unit, so that they
                # do not keep the previous unit's buffer alive while the next one is gathered.
                del out, owned
            del tensor
        missing = sorted(set(plan.targets) - seen)
        if missing:
            raise IncompleteSyncError(
                f"{len(missing)} planned parameter(s) were never gathered: {', '.join(missing[:10])}"
                f"{' ...' if len(missing) > 10 else ''}. The model structure changed after the first sync."
            )

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync's stream with no writer behind it (`fsdp_sync.full_weights`): full tensors under checkpoint
        names, cast, each its own copy; every rank must drain it (it runs the gathers)."""
        plan = self.plan()
        self.meter.start()
        yield from self._stream(plan, {"bytes": 0, "tensors": 0}, copy_all=True)

    def _push(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand the stream to the writer, then agree with every rank on the outcome before anyone goes on.

        NOTE: the gather inside the stream is a sequence of collectives that every rank runs. A writer that fails
        part-way (a dead server, an engine error) stops consuming it; the rest of the stream is then drained here so
        that this rank still enters every collective the other ranks are waiting in. Only then do all ranks agree on
        the outcome (one int all-reduce), so a failure on any rank is raised on every rank and none blocks.
        """
        error: Exception | None = None
        if self.writer.pushes:
            try:
                self.writer.write(stream)
            except Exception as e:
                error = e
        leftover = sum(1 for _ in stream)
        if error is None and leftover and self.writer.pushes:
            error = IncompleteSyncError(
                f"{self.writer.kind} stopped {leftover} tensor(s) before the end of the weight stream"
            )
        stop_together(
            error,
            "push",
            RemoteSyncError,
            "This rank took part in every gather and stopped with the others; see the failing rank's error.",
        )
        if self.writer.pushes:
            self.writer.finish()

    def sync(self) -> SyncReport:
        """Gather, map, cast and push every parameter once; every rank must call it (it runs collectives).

        Raises:
            The push's own error on a rank whose writer failed, and `RemoteSyncError` on every other rank, after all
            ranks have finished the gather (see `_push`).
        """
        plan = self.plan()
        counts = {"bytes": 0, "tensors": 0}
        self.meter.start()
        start = time.perf_counter()
        self._push(self._stream(plan, counts))
        if self.meter.device.type == "cuda":
            torch.cuda.synchronize(self.meter.device)
        seconds = time.perf_counter() - start
        return SyncReport(
            seconds=seconds,
            bytes=counts["bytes"],
            tensors=counts["tensors"],
            peak_extra_bytes=self.meter.peak_extra_bytes(),
            memory_source=self.meter.source,
            backend=self.backend,
            strategy=self.gatherer.strategy,
            writer=self.writer.kind,
        )
