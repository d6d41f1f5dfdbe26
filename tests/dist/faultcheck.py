"""The fault checker shared by the distributed fault tests (tests/dist/test_sync_failures.py,
test_collective_faults.py, test_adapter_faults.py): one way to inject a raise into a collective, one record of what a
rank raised, and one set of assertions that a fault on one rank failed every rank at once, naming that rank.

Why one module: the three files assert the same contract of `SyncError` (docs/failures.md) on different faults; a
copy in each drifted (one file checked the chained cause and the message's engine sentence, another did not), and
the files imported each other's private helpers.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_sync.errors import SyncError

# The sync's own deadline in these tests (a fault must not be what ends a sync: every rank raises long before it).
TIMEOUT_S = 40.0
# Every rank must raise within this (the bound issue 36 asks for: seconds, not `sync_timeout_s`).
FAST_S = 5.0
# torch.distributed's functions the library's guard calls, wrapped by `Faults`.
WRAPPED = ("all_gather_into_tensor", "gather", "all_gather_object", "all_reduce", "monitored_barrier")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "faults.json"


class Faults:
    """Wraps torch's collectives on this rank; fails the `nth` call (1-based, counted per declared collective name
    from `arm`) of `name`, `before` torch runs it or after it returned. Counts every call per name meanwhile.

    The faults come from outside the library: the wrapper reads the `name` of the library's guard
    (`fsdp_sync.distributed.collective`) only to pick which call to fail; torch's own calls pass."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.originals = {fn: getattr(dist, fn) for fn in WRAPPED}
        self.calls: dict[str, int] = {}
        self.armed: tuple[str, int, bool] | None = None
        self.fired: list[tuple[str, int, bool]] = []
        for fn, original in self.originals.items():
            setattr(dist, fn, self._wrap(original))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            name = caller.f_locals.get("name") if caller.f_code.co_name == "collective" else None
            if name is None:
                return original(*args, **kwargs)
            n = self.calls[name] = self.calls.get(name, 0) + 1
            hit = self.armed is not None and self.armed[:2] == (name, n)
            if hit and self.armed[2]:  # type: ignore[index]
                self.fired.append(self.armed)  # type: ignore[arg-type]
                self.armed = None
                raise RuntimeError(f"injected: torch.distributed.{original.__name__} raised ({name}, call {n})")
            result = original(*args, **kwargs)
            if hit:
                self.fired.append(self.armed)  # type: ignore[arg-type]
                self.armed = None
                raise RuntimeError(f"injected: after torch.distributed.{original.__name__} returned ({name}, call {n})")
            return result

        return wrapped

    def arm(self, fault: tuple[str, int, bool] | None) -> None:
        self.calls = {}
        self.armed = fault


def error_record(error: SyncError) -> dict[str, object]:
    """What a rank raised, as plain data (it crosses the process boundary back to the test)."""
    return {
        "type": type(error).__name__,
        "message": str(error),
        "failures": [(f.rank, f.stage) for f in error.failures],
        "engine": error.engine.status if error.engine is not None else None,
        "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
        # What the message says of the engine is what `engine` (the failed SyncReport's) says.
        "engine_said": error.engine is None or f"This rank's engine {error.engine.describe()}." in str(error),
    }


def check_failed_everywhere(
    error: dict[str, object] | None,
    *,
    rank: int,
    failing: int,
    stage: str,
    fired: int,
    seconds: float,
    label: str,
    marker: str,
    bound_s: float = FAST_S,
) -> None:
    """One faulted sync as one rank saw it (`error` from `error_record`, None if it did not raise): every rank
    raised within `bound_s`, naming only the failing rank and the stage, once; the failing rank raised its own
    error chained to the injected one (`marker`: the injected error's words, quoted in every rank's message), the
    others a `RemoteSyncError`; the fault fired on the failing rank only, once; the engine's state is known and
    the message says it."""
    assert error is not None, f"{label}: rank {rank} did not fail"
    message = str(error["message"])
    assert error["failures"] == [(failing, stage)], (label, rank, error["failures"], message[:600])
    assert f"rank {failing} ({stage})" in message, (label, rank, message[:600])
    assert marker in message, (label, rank, f"the injected error ({marker!r}) is not quoted", message[:600])
    assert message.count("The weight sync failed on") == 1, (label, rank, message[:800])
    if rank == failing:
        assert error["type"] != "RemoteSyncError" and error["cause"] is not None, (label, rank, error)
    else:
        assert error["type"] == "RemoteSyncError", (label, rank, error["type"])
    assert fired == (1 if rank == failing else 0), f"{label}: the fault fired {fired} time(s) on rank {rank}"
    assert seconds < bound_s, f"{label}: rank {rank} took {seconds:.1f} s to raise (bound {bound_s} s)"
    assert error["engine"] != "undefined", (label, rank, error["engine"])
    assert error["engine_said"], (label, rank, error["engine"], message[:800])


def record_faults(run: str, results: list[list[dict[str, object]]]) -> None:
    """With FSDP_VLLM_SYNC_RECORD_FAULTS=1: keep what every rank raised for docs/failures.md's table of collectives
    (`python -m benchmarks.faults`)."""
    if os.environ.get("FSDP_VLLM_SYNC_RECORD_FAULTS") != "1":
        return
    today = datetime.date.today().isoformat()
    rows = [
        {"collective": r["fault"][0], "call": r["fault"][1], "before": r["fault"][2], "sync": i, "rank": rank,  # type: ignore[index]
         "failing": rank == r["failing"], "type": r["error"]["type"], "engine": r["error"]["engine"],  # type: ignore[index]
         "seconds": round(r["seconds"], 4), "measured": today}  # type: ignore[arg-type]
        for rank, records in enumerate(results) for i, r in enumerate(records)
    ]  # fmt: skip
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[run] = rows
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True))
