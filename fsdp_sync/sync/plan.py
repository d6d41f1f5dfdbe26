"""The plan of a sync and the checks before anything is gathered: every trainer name mapped to its checkpoint name
and checked against the engine (once per model structure), what the selection policy needs to know of the engine,
and, on request, NaN/Inf in every rank's own shards.

Failure model: each step is local work on every rank followed by an agreement (`distributed.agreed`), so a rank that
fails here (a wrong name, an unreachable checkpoint, a non-finite weight) fails every rank before any collective of
the gather, and nothing is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fsdp_sync.compat.manifest import ManifestError as _CheckpointMismatch
from fsdp_sync.compat.manifest import check_plan

from ..distributed import Coordinator, agreed, rank
from ..errors import (
    EngineState,
    ManifestError,
    NonFiniteWeightsError,
    RankFailure,
    SyncError,
    agreed_error,
    describe_failures,
)
from ..faults import fault_point
from ..gather.base import Gatherer
from ..writers.base import EngineWriter
from .select import SelectionPolicy
from .stream import SyncPlan, WeightStream
from .verify import EngineDigests

__all__ = ["check_finite", "make_plan"]

logger = logging.getLogger(__name__)


def make_plan(
    stream: WeightStream,
    writer: EngineWriter,
    policy: SelectionPolicy,
    coordinator: Coordinator,
    *,
    own_engine: bool,
    check_manifest: bool,
    verify: bool,
    unchanged: Callable[[], EngineState | None],
) -> tuple[SyncPlan, EngineDigests | None]:
    """Map every trainer parameter to its checkpoint name, check the result against the engine, and tell the policy
    what it needs of the engine; agreed on every rank.

    Args:
        own_engine: this rank writes into an engine (it checks the manifest and, with `verify`, reads digests).
        unchanged: what this rank's engine holds (nothing was sent).

    Returns:
        The checked plan, and the trainer-side digests `verify` fills (None without `verify`, or on a rank without
        an engine).

    Raises:
        ManifestError: on every rank, for any mismatch (the failing ranks' message lists every offender).
        SyncError: on every rank, for any other failure.
    """

    def work() -> tuple[SyncPlan, EngineDigests | None, object]:
        fault_point("plan")
        plan = stream.plan()
        if check_manifest and own_engine:
            check_plan(plan.tensors, writer.manifest())
        verifies, surveys = verify and own_engine, policy.needs_layout and rank() == 0
        layout = writer.engine_layout() if verifies or surveys else None
        digests = EngineDigests.of(layout) if verifies and layout is not None else None
        found = policy.survey(plan, layout) if surveys else None
        writer.prepare(plan.tensors)
        return plan, digests, found

    def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
        text = f"The weight sync failed on {describe_failures(failures)}. Nothing was sent."
        if all(f.error.startswith(f"{_CheckpointMismatch.__name__}:") for f in failures):
            # NOTE: the failing ranks' own message lists every mismatched name; the others name the ranks.
            detail = str(error) if isinstance(error, _CheckpointMismatch) else text
            failure = ManifestError(detail, failures=tuple(failures), engine=unchanged())
            failure.__cause__ = error
            return failure
        return agreed_error(error, failures, unchanged())

    plan, digests, found = agreed(coordinator, "plan", work, failed)
    if policy.needs_layout:
        # NOTE: what the policy chooses decides which collectives run, so every rank must choose alike: what it
        # needs of the engine is read where the engine is known (rank 0; in server mode only it talks to the server).
        found = coordinator.broadcast(found)
    policy.adopt(plan, found)
    for d in plan.dropped:
        logger.info("weight sync: not sending %s: %s", d.name, d.reason)
    return plan, digests


def check_finite(
    gatherer: Gatherer, plan: SyncPlan, coordinator: Coordinator, unchanged: Callable[[], EngineState | None]
) -> None:
    """Before anything is gathered: every rank looks for NaN/Inf in its own shards (no gather); the ranks agree, and
    if any rank found one, every rank raises naming the parameters, and nothing is sent."""

    def work() -> None:
        fault_point("check")
        # NOTE: min and max in one pass (`aminmax`): NaN propagates into both and an infinity is one of them, so
        # both are finite exactly when every element is; measured 30x faster than `isfinite(x).all()` on CPU (no
        # boolean temporary), and one host sync for all of them.
        flags = [
            (name, torch.stack(torch.aminmax(shard.detach())))
            for name, shard in gatherer.local_shards()
            if shard.numel() and shard.is_floating_point()
        ]
        stats = [f.float() for _, f in flags]
        if len({t.device for t in stats}) > 1:
            stats = [t.cpu() for t in stats]
        finite = torch.isfinite(torch.stack(stats)).all(dim=1).tolist() if stats else []
        bad = [plan.targets.get(name, name) for (name, _), ok in zip(flags, finite, strict=True) if not ok]
        if bad:
            raise NonFiniteWeightsError(f"NaN or Inf in this rank's shard of {len(bad)} weight(s): {', '.join(bad)}")

    def failed(error: Exception | None, failures: list[RankFailure]) -> SyncError:
        return NonFiniteWeightsError(
            f"The weight sync refused to push non-finite weights: {describe_failures(failures)}. Nothing was sent; "
            "the engine keeps the previous sync's weights. Training has diverged (look at the loss, the learning "
            "rate, gradient clipping) or a weight was written outside training.",
            failures=tuple(failures),
            engine=unchanged(),
        )

    agreed(coordinator, "check", work, failed)
