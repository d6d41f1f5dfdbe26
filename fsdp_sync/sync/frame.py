"""One sync, whatever it carries: the order of steps every payload keeps, and the point where a sync commits.

    open (control groups, the writer's waits bounded by the deadline, the memory meter)
      -> plan (checked once) -> check_finite -> push (write, or stage beside what is served; every rank agrees)
      -> verify (the engine read back against what was sent) -> publish (the commit point) -> report

Why one body (`SyncFrame.sync`): complete, delta and sparse syncs (`pipeline.WeightSync`) and adapter syncs
(`adapter.AdapterSync`) differ in what they plan, send, read back and publish, never in the guarantees users rely on:
the deadline, `check_finite`, every rank raising together, `verify` before anything moves, versions moved last. Each
kind gives the steps (`_checked_plan`, `_check_finite`, `_push`, `_verify`, `_commit`, ...); the order, the failure handling
and the commit point live here once, so a new payload cannot leave one out.

The commit point is `_commit` on a rank that writes into an engine: it makes what was pushed (and verified) the
version generation is served: the engine's weight version is stamped, or the staged adapter version becomes the one
requests name (the previous one evicted). Before it, a failure moves nothing: every rank raises, the engine serves
what it served before (a staged adapter is dropped). After it, the outcome is learnt, never guessed:
- the writing rank knows its own commit (a request that raised is read back by the writer: `ServerWriter.stamp`);
  it records it in the training world's store (`Coordinator.record_outcome`) and runs the trainer's publish hook
  (`on_publish`: the async trainer's `model_version` and rollout worker) at once, so the trainer's versions move
  with the server's before any rollout is labelled;
- every rank then learns the outcome in one agreement. When that agreement itself fails (a rank raised inside it),
  a rank that does not write reads the writer's record from the store: a committed sync is raised on every rank as
  landed (`SyncError.landed`, the version the engine serves named), with the trainer's versions moved on every rank
  that learnt it, so the server's version, `model_version` and the rollout worker never disagree once the error
  is raised.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from ..config import SyncConfig
from ..distributed import Coordinator
from ..errors import EngineState, SyncError, agreed_error
from ..report import SyncReport
from ..writers.base import BoundedWriter, EngineWriter, SharedWriter
from .contract import PublishHook, writer_budget

__all__ = ["Pushed", "SyncFrame", "Verified"]

logger = logging.getLogger(__name__)

# The outcome records (`Coordinator.record_outcome`).
_LANDED, _UNMOVED, _NO_ENGINE = "landed", "unmoved", "none"
# How long a rank that failed inside the last agreement waits for the writer's record of its commit.
_LEARN_WAIT_S = 30.0


@dataclass
class Pushed:
    """What one push left on this rank, for verify, publish and the report.

    Attributes:
        engine: this rank's engine after the push (None on a rank that writes into none).
        seconds: the push's own time (the report's `seconds`).
        detail: the kind's own record of the push (its payload, its pass), read by its later steps only.
    """

    engine: EngineState | None
    seconds: float
    detail: Any = None


@dataclass(frozen=True)
class Verified:
    """What `verify` compared: tensors (or a tensor-parallel worker's cuts) checked, those it could not check, and
    the seconds it took."""

    checked: int
    unverifiable: int = 0
    seconds: float = 0.0


class SyncFrame:
    """The one `sync()` of every sync kind; a kind (a subclass) gives the steps. Every rank calls `sync()`.

    A kind's constructor calls `_frame(config, writer, coordinator, backend)` first.

    Attributes:
        on_publish: the trainer's hook run when a sync commits (`PublishHook`); None: nothing to move.
    """

    config: SyncConfig
    writer: EngineWriter
    coordinator: Coordinator
    backend: str
    on_publish: PublishHook | None = None

    def _frame(self, config: SyncConfig, writer: EngineWriter, coordinator: Coordinator, backend: str) -> None:
        self.config = config
        self.writer = writer
        self.coordinator = coordinator
        self.backend = backend
        # Decided once: whether this rank's writer has waits outside this process to bound by the sync's deadline
        # (a rank that sends a share of each push waits on the server's workers too).
        sends = writer.pushes or (isinstance(writer, SharedWriter) and writer.shares)
        self._bounded = writer if sends and isinstance(writer, BoundedWriter) else None

    # --- the steps a kind gives ---

    def _open(self) -> None:
        """Local set-up at the start of each sync (the memory meter)."""

    def _checked_plan(self) -> Any:
        """The kind's plan, checked on every rank at the first sync (cached); raises `SyncError` on every rank."""
        raise NotImplementedError

    def _check_finite(self, plan: Any) -> None:
        """`SyncConfig(check_finite=True)`: refuse NaN/Inf before anything is sent, on every rank."""
        raise NotImplementedError

    def _push(self, plan: Any) -> Pushed:
        """Send this sync's payload and write (or stage) it; every rank agrees on the outcome before it returns."""
        raise NotImplementedError

    def _verify(self, pushed: Pushed) -> Verified:
        """Read the engine back and compare it with what was sent; agreed on every rank (`VerifyError`)."""
        raise NotImplementedError

    def _commit(self, pushed: Pushed) -> str | None:
        """On a rank that writes: make what was pushed the version generation is served; returns that version
        (None where the engine keeps none). Raises when it did not happen (a writer that cannot tell reads back)."""
        raise NotImplementedError

    def _served(self) -> str | None:
        """The version generation is served on this rank's engine now (the last one committed)."""
        raise NotImplementedError

    def _published(self, pushed: Pushed) -> int | None:
        """What `on_publish` is told: the adapter version committed (None for weights)."""
        return None

    def _landed(self, pushed: Pushed) -> None:
        """This rank learnt that the sync committed: the kind's own record of what is served moves (local work)."""

    def _abandon(self) -> None:
        """After a failure before the commit: drop what was staged (the engine keeps serving what it served)."""

    def _forget(self) -> None:
        """After any failed sync: what the next sync may no longer assume (it sends everything)."""

    def _report(self, pushed: Pushed, verified: Verified | None) -> SyncReport:
        """The report of a sync that committed on every rank (and what the kind settles after it)."""
        raise NotImplementedError

    # --- the one body ---

    def sync(self) -> SyncReport:
        """One sync in the order of the module's docstring; every rank must call it (it runs collectives).

        Raises:
            SyncError: on every rank when any rank failed. Before the commit point nothing moved (the engine serves
                what it served before; the error says which version). After it, `landed` is set: the sync's
                weights and version are in, and the trainer's versions moved with them. `NonFiniteWeightsError`
                before anything is sent with `check_finite`; `VerifyError` with `verify`; `SyncTimeoutError` when a
                rank does not arrive in time. The next sync sends everything.
        """
        config = self.config
        self.coordinator.reopen()
        if self._bounded is not None:
            self._bounded.bound(time.monotonic() + writer_budget(config.sync_timeout_s))
        self._open()
        try:
            plan = self._checked_plan()
            if config.check_finite:
                self._check_finite(plan)
            pushed = self._push(plan)
            verified = self._verify(pushed) if config.verify else None
        except SyncError as e:
            self._failed(e, landed=False)
            raise
        self._publish(pushed)
        return self._report(pushed, verified)

    def _failed(self, error: SyncError, *, landed: bool) -> None:
        """Every failure: the kind forgets (and drops what it staged, before the commit); the writing rank's error
        says which version its engine serves."""
        error.landed = landed
        if not landed:
            try:
                self._abandon()
            except Exception as e:  # noqa: BLE001 - the sync's own failure is the one raised
                logger.error("weight sync: dropping what the failed sync staged: %s", e, exc_info=e)
        self._forget()
        if error.engine is not None and error.engine.version is None:
            error.engine = dataclasses.replace(error.engine, version=self._served())

    def _publish(self, pushed: Pushed) -> None:
        """The commit point, and every rank learning its outcome (the module's docstring)."""
        error: Exception | None = None
        stage = "publish"
        outcome = _NO_ENGINE
        if self.writer.pushes:
            try:
                self._commit(pushed)
                outcome = _LANDED
            except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
                error, outcome = e, _UNMOVED
            self.coordinator.record_outcome(outcome)
            if outcome == _LANDED:
                error, stage = self._settle(pushed), "settle"
        try:
            failures = self.coordinator.agree_on(stage, error)
        except SyncError as e:
            raise self._told_after_commit(e, outcome, pushed) from e
        # NOTE: a commit that failed is agreed as stage `publish`; a failure after a commit (the trainer's hook) as
        # `settle`: a rank without an engine learns from the stages whether the writer committed.
        landed = outcome == _LANDED or (outcome == _NO_ENGINE and not any(f.stage == "publish" for f in failures))
        if outcome == _NO_ENGINE and landed:
            self._settle(pushed)
        if not failures:
            return
        failed = agreed_error(error, failures, self._state_after(outcome, pushed))
        self._failed(failed, landed=landed)
        raise failed

    def _settle(self, pushed: Pushed) -> Exception | None:
        """This rank learnt the sync landed: the kind's record moves, then the trainer's versions (`on_publish`);
        the hook's failure is returned (the sync landed all the same)."""
        self._landed(pushed)
        if self.on_publish is None:
            return None
        try:
            self.on_publish(self._published(pushed))
        except Exception as e:  # noqa: BLE001 - agreed by the caller; the sync landed
            logger.error("weight sync: the trainer's versions did not move with the engine's: %s", e, exc_info=e)
            return e
        return None

    def _state_after(self, outcome: str, pushed: Pushed) -> EngineState | None:
        """This rank's engine after the publish step: its weights are this sync's; its version moved or not."""
        engine = pushed.engine
        if engine is None or outcome == _NO_ENGINE:
            return engine
        if outcome == _LANDED:  # every rank had agreed on the push (and verify): all of it is what is served
            return EngineState("current", version=self._served(), note="the sync committed here")
        return EngineState(
            engine.status,
            engine.previous,
            engine.undefined,
            "its weight version was not moved to this sync"
            if self._published(pushed) is None
            else "the new adapter version was not published: requests still name the previous one",
            version=self._served(),
        )

    def _told_after_commit(self, error: SyncError, outcome: str, pushed: Pushed) -> SyncError:
        """The agreement that tells the commit's outcome failed on some rank: the outcome is this rank's own (a
        writer) or read from the writer's record (a rank without an engine); never guessed."""
        landed = outcome == _LANDED
        if outcome == _NO_ENGINE:
            learnt = self.coordinator.learn_outcomes(min(self.config.sync_timeout_s, _LEARN_WAIT_S))
            if learnt is None:
                logger.error(
                    "weight sync: this rank could not learn whether the sync committed on the writing rank; its "
                    "versions are left where they were"
                )
            elif _LANDED in learnt.values():
                landed = True
                self._settle(pushed)
        else:
            error.engine = self._state_after(outcome, pushed)
        self._failed(error, landed=landed)
        return error
