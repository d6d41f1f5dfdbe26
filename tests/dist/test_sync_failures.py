"""A sync that fails on one rank fails on every rank, fast, leaves every engine holding only previous or new values,
and leaves the ranks able to train and sync again.

2 and 3 gloo ranks, real FSDP1 and FSDP2 with the default (flat) gatherers, the real pipeline, status rounds and
agreement; the engine is a recording writer (the end-to-end tests in `tests/e2e/test_failures.py` do the same against
real vLLM engines and a real server). Faults are injected through the library's own seam (`fsdp_sync.faults`), on
the last rank, at every fault point a sync of this set-up reaches, early and late: every rank must raise within a few
seconds naming that rank and the stage the fault model declares (the assertions of `tests/dist/faultcheck.py`,
shared by the fault files); every tensor the engine took must be the previous
or the new value (no placeholder); then a training step and a sync must succeed, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import pytest
import torch

from fsdp_sync.backend import detect_backend
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import EngineState, SyncError
from fsdp_sync.gather import make_gatherer
from fsdp_sync.sync.pipeline import WeightSync
from tests.support.dist import run_distributed
from fsdp_sync.writers import EnginePushError

from .faultcheck import check_failed_everywhere, error_record
from .models import tiny_lm, train_step, wrap


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
    return WeightSync(
        gatherer,
        engine,
        SyncConfig(delta=False, check_manifest=False, sync_timeout_s=timeout_s),
        backend=backend.value,
    )


def _expected(model: torch.nn.Module, backend: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix("_orig_mod."): v.detach().to("cpu") for k, v in state.items() if k != "lm_head.weight"}


# (point, which call fails): every point a sync of this set-up reaches, early and late. The e2e tests inject the
# others: build and plan (once, before the first gather), check and agree.exchange (delta syncs, check_finite), the
# sparse round's (sparse syncs), verify (an engine with digests).
POINTS = [
    ("gather.prepare", "first"),
    ("gather.prepare", "last"),
    ("gather.launch", "first"),
    ("gather.launch", "last"),
    ("gather.unflatten", "first"),
    ("gather.unflatten", "last"),
    ("stream.map", "first"),
    ("stream.cast", "late"),
    ("write", "first"),
    ("write", "late"),
    ("write.finish", "first"),
    ("agree.outcome", "first"),
]


def fault_points_scenario(rank: int, world_size: int, backend: str) -> list[dict[str, object]]:
    """For each of `POINTS` on the last rank: a complete sync (the engine's previous values), a training step, the
    faulted sync, then a training step and a clean sync, checked bit for bit."""
    from fsdp_sync.faults import FAULT_POINTS, Injector, injecting

    model = wrap(tiny_lm(), backend, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = RecordingEngine()
    sync = _sync(model, engine, timeout_s=60)
    armed: dict[str, object] = {}
    calls: dict[str, int] = {}

    def act(point: str, context: dict[str, object]) -> bool:
        n = calls[point] = calls.get(point, 0) + 1
        if rank != world_size - 1 or point != armed.get("point") or armed.get("fired"):
            return False
        match armed["where"]:
            case "first":
                hit = n == 1
            case "last":
                hit = context.get("unit") == context.get("units", 0) - 1
            case _:  # late: the 8th call (a sync of this model has more tensors)
                hit = n == 8
        armed["fired"] = hit
        return hit

    injector = Injector(act)
    out = []
    with injecting(injector):
        for step, (point, where) in enumerate(POINTS):
            armed.clear()
            sync.sync()  # every engine weight at its previous value
            previous = {n: t.clone() for n, t in engine.weights.items()}
            train_step(model, optimizer, seed=step)
            new = _expected(model, backend)
            armed.update(point=point, where=where)
            calls.clear()
            fired = len(injector.fired)
            start = time.perf_counter()
            record: dict[str, object] = {"point": point, "where": where, "stage": FAULT_POINTS[point].stage}
            try:
                sync.sync()
                record["error"] = None
            except SyncError as e:
                record["error"] = error_record(e)
            record["seconds"] = time.perf_counter() - start
            record["fired"] = len(injector.fired) - fired
            # Every tensor the engine holds is its previous or its new value: none is a third (a placeholder).
            record["neither"] = sorted(
                name for name, t in engine.weights.items()
                if not torch.equal(t, new[name]) and not torch.equal(t, previous.get(name, t.new_empty(0)))
            )  # fmt: skip
            armed.clear()
            train_step(model, optimizer, seed=100 + step)
            sync.sync()
            expected = _expected(model, backend)
            record["after"] = sorted(n for n, t in expected.items() if not torch.equal(engine.weights.get(n, t[:0]), t))
            out.append(record)
    return out


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


@pytest.mark.parametrize("backend, world", [("fsdp1", 2), ("fsdp2", 2), ("fsdp1", 3), ("fsdp2", 3)])
def test_every_fault_point_fails_every_rank_fast_and_the_engine_holds_old_or_new(backend: str, world: int) -> None:
    results = run_distributed(fault_points_scenario, backend, world_size=world)
    failing = world - 1
    for rank, records in enumerate(results):
        for r in records:
            label = f"{backend} x{world} {r['point']} ({r['where']}), rank {rank}"
            check_failed_everywhere(
                r["error"],
                rank=rank,
                failing=failing,
                stage=r["stage"],
                fired=r["fired"],
                seconds=r["seconds"],
                label=label,
                marker="injected fault at",
                bound_s=10,
            )
            assert r["neither"] == [], f"{label}: the engine holds neither old nor new values for {r['neither']}"
            assert r["after"] == [], f"{label}: not bit-exact after the recovery sync: {r['after']}"
        slowest = max(r["seconds"] for r in records)
        print(f"{backend} x{world}: rank {rank} failed {len(records)} faults, slowest after {slowest * 1000:.0f} ms")


def test_a_rank_that_hangs_is_named_after_the_timeout() -> None:
    """Rank 1 hangs in its push before taking anything, so it never reaches the first status round: rank 0 gives
    up on it after `sync_timeout_s`, then on the agreement, and raises SyncTimeoutError naming rank 1; rank 1, when
    it wakes, learns the others gave up. Nobody waits for gloo's or NCCL's own 30-minute timeout. The training group
    is unusable afterwards (a collective timed out), as the error says: the ranks leave without a final barrier."""
    results = run_distributed(hang_scenario, "fsdp2", clean_exit=False)
    first, late = results
    assert first["error"] == "SyncTimeoutError", first
    assert "Ranks 1 failed to pass monitoredBarrier" in first["message"], first["message"]
    assert "reached a status round of this weight sync within 3 s" in first["message"], first["message"]
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
