"""Measurement helpers shared by the CPU and GPU benchmarks."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Measurement", "RssPeak", "measure", "server_writer", "wrap_fsdp"]


class RssPeak:
    """Peak resident-set growth of this process while the block runs, sampled every `interval` seconds.

    Why sampling: torch keeps no CPU allocator high-water mark; every method is measured the same way.
    """

    def __init__(self, interval: float = 0.0005) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak_bytes = 0

    def __enter__(self) -> RssPeak:
        self._base = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._max = self._base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, self._proc.memory_info().rss)
        self.peak_bytes = self._max - self._base


@dataclass
class Measurement:
    model: str
    backend: str
    method: str
    rep: int
    seconds: float
    tensors: int
    bytes: int
    peak_extra_bytes: int
    peak_source: str
    world_size: int
    rank: int

    def row(self) -> dict[str, Any]:
        return asdict(self)


def measure(fn: Callable[[], tuple[int, int]], device: torch.device) -> tuple[float, int, int, int, str]:
    """Run `fn` (returns tensors, bytes) once on every rank; (seconds, tensors, bytes, peak bytes, peak source).

    On CUDA the peak is the allocator's high-water mark above what was allocated before; on CPU the sampled RSS.
    """
    if dist.is_initialized():
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        tensors, nbytes = fn()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return seconds, tensors, nbytes, torch.cuda.max_memory_allocated(device) - base, "cuda_allocator"
    with RssPeak() as rss:
        start = time.perf_counter()
        tensors, nbytes = fn()
        seconds = time.perf_counter() - start
    return seconds, tensors, nbytes, rss.peak_bytes, "rss_sampled"


def wrap_fsdp(model: torch.nn.Module, backend: str, device: torch.device) -> torch.nn.Module:
    """Shard a transformers causal LM the way accelerate does: one unit per decoder layer, plus the root."""
    layer_cls = type(model.model.layers[0])
    world = dist.get_world_size()
    match backend:
        case "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            device_id = torch.device("cpu") if device.type == "cpu" else device
            return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=device_id, use_orig_params=True)
        case "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        case _:
            raise ValueError(f"backend {backend!r}; valid: fsdp1, fsdp2")


def answer_rounds_locally(coordinator: Any) -> None:
    """Make `coordinator` (a sync's `fsdp_sync.distributed.Coordinator`) answer each status round from this rank's
    own flag, without a collective: what the failure protocol's rounds cost is the difference (docs/failures.md).

    NOTE: benchmark-side only (a failure on another rank would go unseen), through the coordinator's private round
    record: the library offers no way to turn its rounds off, on purpose.
    """
    from fsdp_sync.distributed import _Round, rank

    def start_round(failed: bool) -> _Round:
        return _Round(None, torch.tensor([int(failed)], dtype=torch.uint8), (rank(),))

    coordinator.start_round = start_round


def median(values: list[float]) -> float:
    return statistics.median(values)


def server_writer(base_url: str, rank: int, group_port: int) -> Any:
    """The library's `ServerWriter` for one trainer rank of a server benchmark, with `SyncConfig()`'s bounds and
    buffer (rank 0 talks to the server; the other ranks only gather)."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.server_client import ServerClient
    from fsdp_sync.writers.server import ServerWriter

    config = SyncConfig()
    client = ServerClient(base_url, timeout=config.server_timeout_s)
    return ServerWriter(
        client if rank == 0 else None,
        client.server_info(),
        group_port=group_port,
        buffer_bytes=config.server_buffer_bytes,
        timeout_s=config.server_timeout_s,
    )
