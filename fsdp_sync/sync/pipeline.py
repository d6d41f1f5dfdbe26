"""Complete, delta and sparse syncs: the weights' steps of the one sync (`frame.SyncFrame`: plan -> check -> select ->
push -> verify -> publish -> settle -> report).

Where each step lives (`fsdp_sync/sync/`): the plan and the checks before any gather (`plan.py`), what this sync
sends (a selection policy chosen once, `select.py`: everything, `delta.py`, `sparse.py`), the data path (`stream.py`),
the push with this rank's role decided once (`push.py`), the engine's digests (`verify.py`). `WeightSync` gives the
steps, never the modes; their order, and the commit point, are the frame's.

Failure behaviour (docs/failures.md): whatever fails on one rank, every rank finishes its part of the gathers, then
all ranks agree on the outcome within `SyncConfig.sync_timeout_s`, and every rank raises one `SyncError` naming each
failing rank, its stage and its error, and what its own engine holds; the next sync is then complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fsdp_sync.compat.layout import Layout
from fsdp_sync.compat.names import NameRules

from ..config import SyncConfig
from ..distributed import Coordinator
from ..gather.base import Gatherer
from ..memory import MemoryMeter
from ..peft_merge import PeftMerge
from ..report import SyncReport
from ..writers.base import EngineWriter
from .frame import Pushed, SyncFrame, Verified
from .plan import check_finite, make_plan
from .push import Push
from .select import Everything, SelectionPolicy
from .stream import SyncPlan, WeightStream
from .verify import EngineDigests, verify_push

__all__ = ["PolicyFactory", "WeightSync"]

logger = logging.getLogger(__name__)

# What `WeightSync` does when given no config: every sync complete (the mixin passes the user's `SyncConfig`,
# whose default is delta syncs).
_COMPLETE = SyncConfig(delta=False)

# Builds the selection policy of a sync's mode from the sync (its gatherer, coordinator, push, meter); the modes are
# known where the sync is assembled (`fsdp_sync.assemble.policy_for`), never here.
PolicyFactory = Callable[["WeightSync"], SelectionPolicy]


class WeightSync(SyncFrame):
    """Joins one weight stream and one writer; `sync()` (the frame's) runs one push.

    Args:
        gatherer: produces full tensors by trainer name.
        writer: the engine transport.
        config: the sync's options; without one, every sync is complete and nothing optional runs.
        rules: name-mapping tables for this model.
        layout: converts trainer layout to checkpoint layout (identity for most models).
        merge: adds PEFT adapter deltas to their base weights (PEFT models only).
        backend: name of the detected backend, for reports.
        device: device of the full tensors, for memory measurement.
        uncast: checkpoint names sent in the trainer's dtype (the engine keeps them wider than its own dtype:
            `EngineManifest.wider`); never patched (a patch carries engine-dtype values).
        policy: builds what each sync sends (`config`'s mode); None: every sync complete, which a config that
            asks for delta syncs refuses.

    Raises:
        ValueError: `config.delta` without a `policy` (the option would be silently skipped).
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
        policy: PolicyFactory | None = None,
    ) -> None:
        config = config or _COMPLETE
        if policy is None and config.delta:
            raise ValueError(
                "WeightSync was given SyncConfig(delta=True) without a selection policy; build the sync with "
                "fsdp_sync.assemble.build_sync (or pass policy=fsdp_sync.assemble.policy_for)"
            )
        self._frame(config, writer, Coordinator(config.sync_timeout_s), backend)
        self.uncast = uncast
        self.gatherer = gatherer
        self.meter = MemoryMeter(torch.device(device))
        self.stream = WeightStream(
            gatherer, rules=rules, layout=layout, merge=merge, dtype=writer.engine_dtype, meter=self.meter, uncast=uncast
        )
        self.push = Push(writer, self.stream, gatherer, self.coordinator)
        self.policy: SelectionPolicy = policy(self) if policy is not None else Everything()
        self._plan: SyncPlan | None = None
        self._digests: EngineDigests | None = None

    @property
    def merge(self) -> PeftMerge | None:
        return self.stream.merge

    # --- the `contract.Sync` the mixin drives ---

    serves_adapter = False
    adapter_prefix = None

    @property
    def strategy(self) -> str:
        return self.gatherer.strategy

    @property
    def writer_kind(self) -> str:
        return self.writer.kind

    @property
    def sync_plan(self) -> SyncPlan | None:
        return self._plan

    def adapter_request(self) -> object | None:
        return None  # merged weights: generation names no adapter

    @property
    def checked_plan(self) -> SyncPlan | None:
        """The plan once it has passed its check (first sync), else None; reading it runs no collective."""
        return self._plan

    def plan(self) -> SyncPlan:
        """Map every trainer parameter to its checkpoint name and check the result against the engine (cached).

        Raises:
            ManifestError: on any rank, for any mismatch; raised on every rank so that none enters a collective.
        """
        if self._plan is None:
            plan, self._digests = make_plan(
                self.stream,
                self.writer,
                self.policy,
                self.coordinator,
                own_engine=self.push.own_engine,
                check_manifest=self.config.check_manifest,
                verify=self.config.verify,
                unchanged=self.push.unchanged,
            )
            self.push.planned(plan.tensors)
            self._plan = plan
        return self._plan

    def resync(self) -> None:
        """Make the next sync complete (and dense): after the engine's weights were replaced outside this sync (a
        restarted engine, a checkpoint loaded into it), when what it holds can no longer be assumed."""
        self.policy.forget()
        if self._digests is not None:
            self._digests.forget()

    # --- the steps of `frame.SyncFrame.sync` ---

    def _open(self) -> None:
        self.meter.start()

    def _checked_plan(self) -> SyncPlan:
        return self.plan()

    def _check_finite(self, plan: SyncPlan) -> None:
        check_finite(self.gatherer, plan, self.coordinator, self.push.unchanged)

    def _push(self, plan: SyncPlan) -> Pushed:
        payload = self.policy.choose(plan)
        digests = self._digests
        if digests is not None:
            digests.reset()
            if payload.fresh:  # the engine was replaced: nothing to compare with what it held before
                digests.forget()
        start = time.perf_counter()
        engine, run = self.push.run(plan, payload, digests)
        if self.meter.device.type == "cuda":
            torch.cuda.synchronize(self.meter.device)
        seconds = time.perf_counter() - start + payload.patch_seconds
        return Pushed(engine, seconds, (payload, run))

    def _verify(self, pushed: Pushed) -> Verified:
        started = time.perf_counter()
        digests = self._digests
        result = verify_push(self.coordinator, self.writer.engine_digests, digests, pushed.engine)
        if result.unverifiable:
            logger.warning("weight sync: %s", result.describe_unverifiable())
        seconds = time.perf_counter() - started + (digests.seconds if digests is not None else 0.0)
        return Verified(result.checked, len(result.unverifiable), seconds)

    def _commit(self, pushed: Pushed) -> str | None:
        return self.push.commit()

    def _served(self) -> str | None:
        return self.push.served

    def _forget(self) -> None:
        self.resync()  # the engine may hold anything the failure left: the next sync is complete

    def _report(self, pushed: Pushed, verified: Verified | None) -> SyncReport:
        payload, run = pushed.detail
        settled = self.policy.settle(payload)
        return SyncReport(
            seconds=pushed.seconds,
            bytes=run.bytes,
            tensors=run.tensors,
            peak_extra_bytes=self.meter.peak_extra_bytes(),
            memory_source=self.meter.source,
            backend=self.backend,
            strategy=self.gatherer.strategy,
            writer=self.writer.kind,
            verified=verified.checked if verified is not None else None,
            unverifiable=verified.unverifiable if verified is not None else None,
            verify_seconds=verified.seconds if verified is not None else 0.0,
            figures=self.policy.report(payload, settled),
            sent_bytes=self.push.sent_bytes,
            worker_bytes=self.push.worker_bytes,
        )
