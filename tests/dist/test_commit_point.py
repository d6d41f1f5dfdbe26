"""The commit point (`fsdp_sync.sync.frame`): a rank failing in each of a sync's last collectives, server-like (rank 0
alone writes into a versioned engine, rank 1 only gathers), with the trainer's versions moved by a publish hook as
the async trainer's seam moves `model_version` and its rollout worker.

The fault is injected from outside the library, through torch: rank 1's `torch.distributed.monitored_barrier` (the
first collective of every agreement) raises at the last, or the one before the last, agreement of a sync (counted
in a clean sync first). Failing in the last one comes after rank 0 stamped the engine: every rank must raise a
`SyncError` with `landed` set, and the engine's version, every rank's `model_version` and the rollout worker's must
agree once the error is raised; the error names the version the engine serves. Failing in the one before moves
nothing anywhere. Then a training step and a sync succeed, bit for bit. Real FSDP1/FSDP2 on 2 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.backend import detect_backend
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import SyncError
from fsdp_sync.gather import make_gatherer
from fsdp_sync.sync.pipeline import WeightSync
from tests.support.dist import run_distributed

from .models import tiny_lm, train_step, wrap
from .test_sync_failures import RecordingEngine, _expected


class VersionedEngine(RecordingEngine):
    """A server-like engine: it keeps a weight version, stamped with the trainer's next policy version as its
    label (as `ServerWriter(version_label=...)` does for the async trainer)."""

    def __init__(self, label: Any) -> None:
        super().__init__()
        self.version = "default"
        self.label = label

    def replaced(self) -> str | None:
        return None

    def stamp(self, version: str) -> str:
        self.version = f"{version}:{self.label()}"
        return self.version


class Draining(RecordingEngine):
    """A rank that writes into no engine (server mode's other ranks)."""

    pushes = False


def scenario(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    model = wrap(tiny_lm(), backend, world_size)
    assert detect_backend(model).value == backend
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = {"model_version": 0, "rollout_worker": 0}
    engine = VersionedEngine(lambda: f"v{policy['model_version'] + 1}") if rank == 0 else Draining()
    config = SyncConfig(delta=False, check_manifest=False, sync_timeout_s=30)
    sync = WeightSync(make_gatherer(model, detect_backend(model), config), engine, config, backend=backend)

    def publish(adapter_version: int | None) -> None:  # the async seam's hook, recorded
        policy["model_version"] += 1
        if rank == 0:
            policy["rollout_worker"] = policy["model_version"]

    sync.on_publish = publish
    barrier = dist.monitored_barrier
    calls = {"n": 0, "fail_at": None}

    def counted_barrier(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if rank == 1 and calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected: rank 1's monitored_barrier")
        return barrier(*args, **kwargs)

    dist.monitored_barrier = counted_barrier
    out: dict[str, Any] = {"rank": rank, "syncs": []}
    try:
        sync.sync()  # the first sync (its plan agreements)
        train_step(model, optimizer, seed=1)
        calls["n"] = 0
        sync.sync()  # a clean later sync: how many agreements it runs
        per_sync = calls["n"]
        out["agreements"] = per_sync
        for step, last in enumerate((per_sync, per_sync - 1, None), start=2):
            train_step(model, optimizer, seed=step)
            calls["n"], calls["fail_at"] = 0, last
            record: dict[str, Any] = {"fail_at": last}
            try:
                sync.sync()
                record["error"] = None
            except SyncError as e:
                record["error"] = {
                    "type": type(e).__name__,
                    "landed": e.landed,
                    "message": str(e),
                    "version": e.engine.version if e.engine is not None else None,
                    "status": e.engine.status if e.engine is not None else None,
                }
            record["model_version"] = policy["model_version"]
            record["rollout_worker"] = policy["rollout_worker"]
            record["engine_version"] = engine.version if rank == 0 else None
            expected = _expected(model, backend)
            record["stale"] = (
                sorted(n for n, t in expected.items() if not torch.equal(engine.weights.get(n, t[:0]), t))
                if rank == 0
                else []
            )
            out["syncs"].append(record)
    finally:
        dist.monitored_barrier = barrier
    return out


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_rank_failing_in_the_last_collectives_leaves_the_versions_agreeing(backend: str) -> None:
    ranks = run_distributed(scenario, backend)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["agreements"] == ranks[1]["agreements"] >= 2
    after_commit, before_commit, clean = zip(*(r["syncs"] for r in ranks), strict=True)
    # the last agreement fails on rank 1 after rank 0 stamped: landed on every rank, everything moved together
    for r, record in enumerate(after_commit):
        error = record["error"]
        assert error is not None and error["landed"], record
        assert "had committed before the failure" in error["message"], error["message"]
        assert record["model_version"] == 3, record
    version = after_commit[0]["engine_version"]
    assert version.endswith(":v3") and after_commit[0]["rollout_worker"] == 3, after_commit[0]
    assert after_commit[0]["error"]["status"] == "current" and after_commit[0]["error"]["version"] == version
    assert f"served version {version}" in after_commit[0]["error"]["message"]
    assert after_commit[0]["stale"] == [], "the landed sync's weights are in"
    # the agreement before it fails: nothing moved anywhere
    for record in before_commit:
        error = record["error"]
        assert error is not None and not error["landed"], record
        assert record["model_version"] == 3, record
    assert before_commit[0]["engine_version"] == version and before_commit[0]["rollout_worker"] == 3
    assert before_commit[0]["error"]["version"] == version, before_commit[0]["error"]
    # a clean sync after both: complete, exact, every version moved once
    for record in clean:
        assert record["error"] is None and record["model_version"] == 4, record
    assert clean[0]["engine_version"].endswith(":v4") and clean[0]["rollout_worker"] == 4
    assert clean[0]["stale"] == []
