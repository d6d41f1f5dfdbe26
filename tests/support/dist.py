"""Run a function on N local processes with a real torch.distributed process group (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_sync.distributed import free_port

__all__ = ["free_port", "run_distributed"]

# NOTE: ranks start from a fork server that imported these once per test process (`forkserver`), not from a fresh
# interpreter each (`spawn`): importing torch and transformers was most of a small distributed test's CPU time on the
# 2-core CI machine (docs/testing.md). The server holds no thread when it forks; a rank still gets a process and a
# gloo group of its own.
_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "fsdp_sync", "tests.support.dist"]


def _entry(
    rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, out: str, clean_exit: bool
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    faulthandler.enable()  # a native crash prints every thread's Python stack into the test's captured stderr
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
        # NOTE: a rank that tears its connections down while a peer still receives its last bytes makes the peer
        # abort (gloo: "Connection closed by peer"); leave together.
        if clean_exit:
            dist.barrier()
    except BaseException as e:  # reported to the parent with the traceback
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        if clean_exit:
            dist.destroy_process_group()
    # NOTE: leave without interpreter finalisation. gloo's worker threads can still hold a finished collective's Work,
    # and with it tensors owned by Python objects; destroying those during finalisation takes the GIL from a C++
    # thread while the interpreter is torn down, which aborts the process (SIGABRT, "terminate called without an
    # active exception"; seen in CI; pytorch/pytorch#179291 describes the mechanism). The result is on disk and the
    # group is destroyed: nothing is left to clean up.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str | None = None,
    clean_exit: bool = True,
    start_method: str = "forkserver",
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned processes; return each rank's result.

    `fn` must be importable (module level) and its result picklable. Raises RuntimeError naming the failing ranks
    with their tracebacks. `clean_exit=False` for a scenario that leaves its process group unusable (a timed-out
    collective): the ranks leave at once, without the final barrier and without destroying the group (joining
    gloo's threads would wait for the collective that never completes). `start_method="spawn"` starts each rank in a
    fresh interpreter (benchmarks/launch_cost.py compares the two).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo")
    mp.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, free_port(), backend, fn, args, out, clean_exit),
                nprocs=world_size,
                join=True,
                start_method=start_method,
            )
        except mp.ProcessExitedException as e:
            written = [r for r in range(world_size) if Path(out, f"rank{r}.pkl").exists()]
            raise RuntimeError(f"{e} (ranks that had written their result before: {written})") from e
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [value for _, value in results]
