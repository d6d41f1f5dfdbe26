"""An adapter sync's exchange (`adapter.pieces`) is inside the failure model: a raise on one rank inside any of its
all-gathers, or just after one returned, makes every rank raise a `SyncError` within seconds naming that rank and
the stage; no engine got anything of that sync; the next sync pushes the trainer's adapter bit for bit.

Faults come from outside the library, as in tests/dist/test_collective_faults.py (`tests/dist/faultcheck.py`'s
`Faults` wraps torch's own `torch.distributed` functions on one rank and picks the call by the name the library's
guard gives it; the assertions are that module's, shared by the fault files). 2 gloo ranks, real FSDP2 and FSDP1 PEFT models (LoRA inside the decoder-layer units), a recording adapter writer: one per rank
(colocate) or on rank 0 only (a rank with `pushes` False, as in server mode). The sparse syncs' collectives are
faulted there; this is the adapter sync's, recorded into the same table of docs/failures.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_distributed
from fsdp_sync.assemble import build_sync
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import SyncError
from fsdp_sync.report import AdapterFigures

from .adapters import RecordingAdapterWriter, full_adapter, peft_lm, save_base, wrap
from .faultcheck import TIMEOUT_S, Faults, check_failed_everywhere, error_record, record_faults
from .models import train_step

NAME = "adapter.pieces"
# (call, before): each of the exchange's three all-gathers (sizes, places, values) before torch ran it, and a raise
# just after the first and the last returned (after the last one the other rank has left the exchange: the agreement
# before the load stops it); a negative call counts from the last of a clean sync.
CASES = [(1, True), (2, True), (-1, True), (1, False), (-1, False)]


def faults_scenario(rank: int, world_size: int, backend: str, per_rank: bool, failing: int, directory: str) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_sync.sync.adapter import AdapterSync

    faults = Faults()
    save_base(directory, seed=0)
    wrapped = wrap(peft_lm(), backend, world_size)
    writer = RecordingAdapterWriter(directory)
    writer.pushes = per_rank or rank == 0
    sync = build_sync(wrapped, writer, SyncConfig(adapter=True, sync_timeout_s=TIMEOUT_S), device=torch.device("cpu"))
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
    faults.arm(None)
    sync.sync()
    calls = faults.calls[NAME]
    records = []
    for step, (n, before) in enumerate(CASES, start=1):
        train_step(wrapped, optimizer, seed=step)
        expected = full_adapter(wrapped)  # a collective: every rank
        fault = (NAME, n if n > 0 else calls + 1 + n, before)
        loaded = len(writer.adapters)
        faults.arm(fault if rank == failing else None)
        record: dict[str, object] = {"fault": fault, "failing": failing}
        started = time.perf_counter()
        try:
            sync.sync()
            record["error"] = None
        except SyncError as e:
            record["error"] = error_record(e)
        record["seconds"] = time.perf_counter() - started
        record["fired"] = list(faults.fired)
        faults.fired.clear()
        faults.arm(None)
        record["written"] = len(writer.adapters) - loaded
        retry = sync.sync().figure(AdapterFigures)
        record["retry_id"] = retry.adapter_id
        last = writer.adapters[-1] if writer.pushes else None
        record["retry_exact"] = last is None or (
            last.adapter_id == retry.adapter_id
            and sorted(last.tensors) == sorted(expected)
            and all(torch.equal(last.tensors[k], expected[k]) for k in expected)
        )
        records.append(record)
    return {
        "wrapper_ok": isinstance(wrapped, FSDP if backend == "fsdp1" else FSDPModule),
        "is_adapter_sync": isinstance(sync, AdapterSync),
        "pushes": writer.pushes,
        "calls": calls,
        "records": records,
    }


@pytest.mark.parametrize("backend, per_rank, failing", [("fsdp2", True, 0), ("fsdp1", False, 1)])
def test_a_raise_in_the_adapter_exchange_fails_every_rank_at_once_and_writes_nothing(
    backend: str, per_rank: bool, failing: int, tmp_path: Path
) -> None:
    """Regression: the adapter sync's three all-gathers ran on the training group outside the guard, so a raise on
    one rank there left the others inside a training-group collective (bounded only by that group's timeout)."""
    results = run_distributed(faults_scenario, backend, per_rank, failing, str(tmp_path))
    mode = "colocate" if per_rank else "server"
    record_faults(f"collectives-adapter-{mode}-{backend}-2-rank{failing}", [r["records"] for r in results])
    for rank, result in enumerate(results):
        assert result["wrapper_ok"] and result["is_adapter_sync"], result
        assert result["pushes"] == (per_rank or rank == 0)
        assert result["calls"] == 3, f"an adapter of one dtype is exchanged in 3 all-gathers: {result['calls']}"
        for i, record in enumerate(result["records"]):
            _, n, before = record["fault"]
            label = f"{backend} {mode} rank {rank}: call {n} {'before' if before else 'after'}"
            check_failed_everywhere(
                record["error"],
                rank=rank,
                failing=failing,
                stage=NAME,
                fired=len(record["fired"]),
                seconds=record["seconds"],
                label=label,
                marker="injected:",
            )
            assert record["error"]["engine"] == ("unchanged" if result["pushes"] else None), (label, record["error"])
            assert record["written"] == 0, f"{label}: the engine got an adapter of the failed sync"
            # The failed sync used no version: the retries are versions 2, 3, ... after the clean first sync.
            assert record["retry_id"] == i + 2, (label, record["retry_id"])
            assert record["retry_exact"], f"{label}: the next sync's adapter is not the trainer's"
        slowest = max(r["seconds"] for r in result["records"])
        print(f"adapter {backend} {mode}, fault on rank {failing}: rank {rank} raised in {len(result['records'])} "
              f"faults, slowest {slowest * 1000:.0f} ms")  # fmt: skip
