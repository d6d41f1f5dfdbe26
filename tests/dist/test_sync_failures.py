"""A sync that fails on one rank fails on every rank, fast, and leaves the ranks able to train and sync again.

2 gloo ranks, real FSDP1 and FSDP2 with the default (flat) gatherers, the real pipeline and agreement; the engine is
a recording writer (the end-to-end tests in `tests/e2e/test_failures.py` do the same against real vLLM engines).
Faults are injected on rank 1 only: in its own gather work (preparing its shard of the first or the last unit, before
that unit's all-gather) and in its push (after the first or the last tensor). Every rank must raise within a few
seconds naming rank 1 and the stage; then a training step and a sync must succeed, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import pytest
import torch

from fsdp_sync.backend import detect_backend
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.compat.names import NameRules
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import EngineState, SyncError
from fsdp_sync.gather import make_gatherer
from fsdp_sync.pipeline import WeightSync
from fsdp_sync.testing.dist import run_distributed
from fsdp_sync.writers import EnginePushError

from .models import full_reference, tiny_lm, train_step, wrap


class RecordingEngine:
    """An engine that keeps what it is given by checkpoint name; `fail_after` makes it fail part-way, `sleep_s`
    makes it hang that long before taking anything (a rank stuck in its push)."""

    kind = "recording"
    pushes = True
    engine_dtype = None
    retains_tensors = True

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_after: int | None = None
        self.sleep_s = 0.0

    def manifest(self) -> EngineManifest:
        raise AssertionError("not checked")

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        self.planned = [t.name for t in planned]

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        time.sleep(self.sleep_s)
        taken = 0
        try:
            for name, tensor in weights:
                if self.fail_after is not None and taken == self.fail_after:
                    raise RuntimeError("injected engine failure")
                self.weights[name] = tensor.clone()
                taken += 1
        except Exception as e:  # as the real writers do: say what the engine holds
            state = EngineState("mixed" if taken else "unchanged")
            raise EnginePushError(f"push stopped after {taken} tensor(s): {e}", engine=state) from e

    def finish(self) -> None:
        """Nothing cached."""


def _sync(model: torch.nn.Module, engine: RecordingEngine, timeout_s: float) -> WeightSync:
    backend = detect_backend(model)
    config = SyncConfig(sync_timeout_s=timeout_s)
    gatherer = make_gatherer(model, backend, config)
    return WeightSync(gatherer, engine, check_manifest=False, timeout_s=timeout_s, backend=backend.value)


def _inject_gather_fault(gatherer: object, unit: int) -> None:
    """Rank 1's own work for one unit (its shard, before the unit's all-gather) raises."""
    prepare = gatherer._prepare  # type: ignore[attr-defined]

    def failing(k: int):  # type: ignore[no-untyped-def]
        if k == unit:
            raise RuntimeError(f"injected: rank 1 cannot prepare its shard of unit {k}")
        return prepare(k)

    gatherer._prepare = failing  # type: ignore[attr-defined]


def _expected(model: torch.nn.Module, backend: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix("_orig_mod."): v.detach().to("cpu") for k, v in state.items() if k != "lm_head.weight"}


def fault_scenario(rank: int, world_size: int, backend: str, stage: str, where: str) -> dict[str, object]:
    model = wrap(tiny_lm(), backend, world_size)
    engine = RecordingEngine()
    sync = _sync(model, engine, timeout_s=60)
    sync.plan()
    units = len(sync.gatherer._sizes)  # type: ignore[attr-defined]
    if rank == 1:
        if stage == "gather":
            _inject_gather_fault(sync.gatherer, 0 if where == "early" else units - 1)
        else:
            engine.fail_after = 1 if where == "early" else len(engine.planned) - 1
    out: dict[str, object] = {"units": units}
    start = time.perf_counter()
    try:
        sync.sync()
        out["error"] = None
    except SyncError as e:
        out["error"] = {
            "type": type(e).__name__,
            "message": str(e),
            "failures": [(f.rank, f.stage) for f in e.failures],
            "undefined": list(e.engine.undefined) if e.engine is not None else None,
            "engine": e.engine.status if e.engine is not None else None,
        }
    out["seconds"] = time.perf_counter() - start
    # The ranks go on together: a training step, then a complete sync, checked bit for bit.
    engine.fail_after = None
    if rank == 1 and stage == "gather":
        del sync.gatherer._prepare  # type: ignore[attr-defined]  # back to the class's own
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    sync.sync()
    expected = _expected(model, backend)
    out["after"] = sorted(n for n, t in expected.items() if not torch.equal(engine.weights.get(n, torch.empty(0)), t))
    out["after_count"] = len(engine.weights)
    return out


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("stage,where", [("gather", "early"), ("gather", "late"), ("push", "early"), ("push", "late")])
def test_a_failure_on_one_rank_fails_every_rank_fast_and_the_next_sync_is_exact(
    backend: str, stage: str, where: str
) -> None:
    results = run_distributed(fault_scenario, backend, stage, where)
    for rank, r in enumerate(results):
        error = r["error"]
        assert error is not None, f"rank {rank} did not fail"
        assert error["failures"] == [(1, stage)], error
        assert "rank 1 (" + stage + ")" in error["message"], error["message"]
        assert r["seconds"] < 10, f"rank {rank} took {r['seconds']:.1f} s to fail"
        print(f"{backend} {stage} {where}: rank {rank} raised {error['type']} after {r['seconds']:.3f} s")
        assert r["after"] == [], f"rank {rank}: not bit-exact after the recovery sync: {r['after']}"
        assert r["after_count"] > 0
    own, other = results[1]["error"], results[0]["error"]
    assert other["type"] == "RemoteSyncError"
    if stage == "gather":
        assert own["type"] == "SyncStageError" and "injected: rank 1 cannot prepare" in own["message"]
        # Rank 0 received rank 1's placeholder for that unit: its engine says which weights are undefined.
        assert other["engine"] == "undefined" and other["undefined"], other
        assert own["engine"] in ("mixed", "unchanged"), own
    else:
        assert own["type"] == "EnginePushError" and "injected engine failure" in own["message"]
        assert other["engine"] == "current"


def hang_scenario(rank: int, world_size: int, backend: str) -> dict[str, object]:
    """Rank 1 hangs in its push for longer than the sync's timeout."""
    model = wrap(tiny_lm(), backend, world_size)
    engine = RecordingEngine()
    sync = _sync(model, engine, timeout_s=3)
    if rank == 1:
        engine.sleep_s = 8
    start = time.perf_counter()
    try:
        sync.sync()
        return {"error": None}
    except SyncError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - start}


def test_a_rank_that_hangs_is_named_after_the_timeout() -> None:
    """Rank 1 hangs in its push before taking anything, so rank 0's first all-gather never completes: rank 0 gives
    up on it after `sync_timeout_s`, then on the agreement, and raises SyncTimeoutError naming rank 1; rank 1, when
    it wakes, learns the others gave up. Nobody waits for gloo's or NCCL's own 30-minute timeout. The training group
    is unusable afterwards (a collective timed out), as the error says: the ranks leave without a final barrier."""
    results = run_distributed(hang_scenario, "fsdp2", clean_exit=False)
    first, late = results
    assert first["error"] == "SyncTimeoutError", first
    assert "Ranks 1 failed to pass monitoredBarrier" in first["message"], first["message"]
    assert "did not complete within 3 s" in first["message"], first["message"]
    assert first["seconds"] < 2 * 3 + 3, first["seconds"]
    assert late["error"] == "SyncTimeoutError", late
    assert "Restart the job" in late["message"]
    print(f"hang: rank 0 raised after {first['seconds']:.2f} s (timeout 3 s), rank 1 after {late['seconds']:.2f} s")


def unsendable_scenario(rank: int, world_size: int) -> dict:
    """Rank 0 hands the coordinator an object that cannot be pickled (a closure); rank 1 a plain one."""
    from fsdp_sync.distributed import Coordinator

    coordinator = Coordinator(timeout_s=30)
    item = (lambda name: name) if rank == 0 else "plain"
    started = time.perf_counter()
    try:
        coordinator.broadcast(item)
    except SyncError as e:
        raised = (type(e).__name__, str(e))
    else:
        raised = None
    seconds = time.perf_counter() - started
    after = coordinator.exchange(rank)  # the group is still usable
    return {"raised": raised, "seconds": seconds, "after": after}


def test_an_item_one_rank_cannot_send_fails_every_rank_at_once() -> None:
    """Regression: an unpicklable object broadcast from rank 0 (a name mapper closure) raised on rank 0 before the
    collective while rank 1 waited inside it until rank 0's process went away."""
    for result in run_distributed(unsendable_scenario):
        assert result["raised"] is not None, "every rank must raise"
        kind, message = result["raised"]
        assert kind == "SyncError" and "rank 0: function cannot be pickled" in message, message
        assert result["seconds"] < 10, result["seconds"]
        assert result["after"] == [0, 1]
