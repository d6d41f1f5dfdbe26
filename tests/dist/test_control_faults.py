"""A rank that fails inside one of the sync's control collectives makes every rank fail at once, and the next sync
rebuilds the control groups (issue 27). 2 and 3 gloo processes; the fault is raised from outside the library, by
torch's own `all_gather_object` on one rank (the collective `Coordinator.exchange` runs for the delta agreement), so
the test holds for any code path that reaches it. The pipeline's own fault points inside the agreements
(`agree.exchange`, `agree.outcome`) are injected with real FSDP in `test_sync_failures.py` and end to end in
`tests/e2e/test_failures.py`.
"""

from __future__ import annotations

import time

import pytest

from tests.support.dist import run_distributed

TIMEOUT_S = 30.0
LINGER_S = 3.0


def exchange_fails_on_one_rank(rank: int, world_size: int) -> dict[str, object]:
    """The last rank's `all_gather_object` raises inside `Coordinator.exchange` (the others are in it); every rank
    records its error and time, then every rank starts a new sync (`reopen`) and exchanges again."""
    import torch.distributed as dist

    from fsdp_sync.distributed import Coordinator
    from fsdp_sync.errors import SyncError

    coordinator = Coordinator(TIMEOUT_S)
    assert coordinator.exchange(rank) == list(range(world_size))
    original = dist.all_gather_object
    if rank == world_size - 1:

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected: all_gather_object failed on this rank")

        dist.all_gather_object = broken  # type: ignore[assignment]
    started = time.perf_counter()
    try:
        coordinator.exchange(("sync 1", rank))
    except SyncError as e:
        raised: dict[str, object] | None = {
            "type": type(e).__name__,
            "message": str(e),
            "failures": [(f.rank, f.stage) for f in e.failures],
        }
    else:
        raised = None
    seconds = time.perf_counter() - started
    dist.all_gather_object = original  # type: ignore[assignment]
    if rank == world_size - 1:
        # The failing rank's process stays up (a trainer that caught the error): the others must not depend on it
        # exiting to see that it left the collective.
        time.sleep(LINGER_S)
    coordinator.reopen()  # the start of the next sync
    after = coordinator.exchange(("sync 2", rank))
    outcome = coordinator.agree(None)
    return {"raised": raised, "seconds": seconds, "after": after, "outcome": outcome}


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_failing_inside_the_agreement_fails_every_rank_at_once_and_the_next_sync_agrees(world: int) -> None:
    """Regression: the failing rank raised at once, the others waited inside the same collective until the control
    group's timeout (`sync_timeout_s`, 600 s by default), and every later sync was refused ("the ranks can no longer
    agree. Restart the job."). Now every rank raises within seconds, naming the failing rank, and the next sync's
    agreement works."""
    results = run_distributed(exchange_fails_on_one_rank, world_size=world)
    failing = world - 1
    for rank, r in enumerate(results):
        raised = r["raised"]
        assert raised is not None, f"rank {rank} did not raise"
        assert raised["failures"] == [(failing, "agree")], raised
        assert raised["type"] == ("SyncStageError" if rank == failing else "RemoteSyncError"), raised
        assert "injected: all_gather_object failed on this rank" in raised["message"], raised["message"]
        assert "rebuilt at the start of the next sync" in raised["message"], raised["message"]
        assert r["seconds"] < LINGER_S - 1, f"rank {rank} took {r['seconds']:.1f} s to raise"
        assert r["after"] == [("sync 2", k) for k in range(world)]
        assert r["outcome"] == []
        print(f"{world} ranks: rank {rank} raised {raised['type']} after {r['seconds'] * 1000:.0f} ms")
