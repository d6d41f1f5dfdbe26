"""Server-mode benchmark: 2 gloo trainer ranks, one real vLLM CPU server process, weight transfer over gloo.

Per model and backend, after one training step, interleaved over several repetitions, all over the same transport
(this package's gloo backend, one transfer group for every method):
- `ours-flat`: the default sync (flat gather, cast to the server's dtype before the gather, announced from the plan);
- `trl`: TRL 1.16's server pattern: its own `_iter_fsdp1_params` / `_iter_fsdp2_params` on the model object TRL
  holds, tensors in the trainer's dtype; the first sync also walks every parameter once for the metadata
  (`trl-first`, measured once);
- `floor`: one push of the same tensors, already full and in the server's dtype (nothing gathered).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .common import Measurement, measure, wrap_fsdp


class _ListSource:
    """A `WeightSource`-shaped view of a list of tensors, or of a generator factory, for the non-ours methods."""

    def __init__(self, meta: list[Any], stream: Any) -> None:
        self._meta = meta
        self._stream = stream

    def metadata(self) -> list[Any]:
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._stream())


def _measure_backend(
    rank: int, world_size: int, model_name: str, model_dir: str, base_url: str, group_port: int, reps: int,
    backend: str,
) -> list[dict[str, Any]]:  # fmt: skip
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ParamMeta

    from fsdp_sync.backend import detect_backend
    from fsdp_sync.compat.layout import IdentityLayout
    from fsdp_sync.compat.names import NameRules, canonical_name
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.memory import MemoryMeter
    from fsdp_sync.sync.pipeline import WeightSync
    from .common import server_writer
    from .cpu import _train_step
    from .trl_path import _generation_stub

    device = torch.device("cpu")
    config = SyncConfig()
    writer = server_writer(base_url, rank, group_port)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_by_trl = model
    wrapped = wrap_fsdp(model, backend, device)
    _train_step(wrapped)
    sync = WeightSync(
        make_gatherer(wrapped, detect_backend(wrapped), config, engine_dtype=writer.engine_dtype),
        writer,
        rules=NameRules(),
        layout=IdentityLayout(),
        backend=backend,
    )
    sync.sync()  # handshake with the server, warm-up
    # NOTE: every method goes over the transfer group our writer opened (the server's gloo engine holds one group);
    # the other methods hand that trainer engine their own source for their round.
    engine = writer._engine
    generation = _generation_stub(held_by_trl, device)
    iterate = generation._iter_fsdp1_params if backend == "fsdp1" else generation._iter_fsdp2_params

    def trl_metadata() -> list[Any]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in iterate(held_by_trl)]

    full = [
        (canonical_name(name), t.to(writer.engine_dtype, copy=True))
        for name, t in sync.gatherer.iter_full(MemoryMeter(device))
    ]
    floor_meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in full]
    floor_bytes = sum(t.numel() * t.element_size() for _, t in full)

    def round_trip(source: Any, all_ranks_iterate: bool) -> None:
        if rank == 0:
            own = engine.source
            engine.source = source
            try:
                engine.send_weights()
            finally:
                engine.source = own
        elif all_ranks_iterate:
            for _ in source:  # the other ranks take part in the gathers
                pass

    trl_meta: list[Any] = []

    def run_trl() -> tuple[int, int]:
        round_trip(_ListSource(trl_meta, lambda: iterate(held_by_trl)), all_ranks_iterate=True)
        return len(trl_meta), sum(m.dtype.itemsize * math.prod(m.shape) for m in trl_meta)

    def run_trl_first() -> tuple[int, int]:
        trl_meta[:] = trl_metadata()  # TRL's first-sync walk over every parameter, kept for the later syncs
        return run_trl()

    def run_floor() -> tuple[int, int]:
        round_trip(_ListSource(floor_meta, lambda: full), all_ranks_iterate=False)
        return len(full), floor_bytes

    def run_ours() -> tuple[int, int]:
        report = sync.sync()
        return report.tensors, report.bytes

    rows: list[dict[str, Any]] = []

    def record(method: str, rep: int, fn: Any) -> None:
        seconds, tensors, nbytes, peak, source = measure(fn, device)
        rows.append(
            Measurement(model_name, backend, method, rep, seconds, tensors, nbytes, peak, source, world_size,
                        rank).row()
        )  # fmt: skip

    record("trl-first", 0, run_trl_first)
    methods = {"trl": run_trl, "floor": run_floor, "ours-flat": run_ours}
    for rep in range(reps):
        order = list(methods)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for method in order:
            record(method, rep, methods[method])
    sync.sync()
    rows.append({"model": model_name, "backend": backend, "method": "ours-flat",
                 "accounted_peak_bytes": sync.meter.accounted_peak_bytes, "rank": rank})  # fmt: skip
    dist.barrier()
    return rows


def server_worker(
    rank: int, world_size: int, model_name: str, model_dir: str, base_url: str, reps: int, ports: list[int]
) -> list[dict[str, Any]]:
    """Both backends against one server; a fresh transfer-group port per backend."""
    rows: list[dict[str, Any]] = []
    for backend, port in zip(("fsdp1", "fsdp2"), ports):
        rows.extend(_measure_backend(rank, world_size, model_name, model_dir, base_url, port, reps, backend))
        time.sleep(0.5)
    return rows
