"""Sparse delta syncs, trainer side: how many engine-dtype (bf16) elements real optimizer steps change, and what
finding and gathering only those costs against the dense gather, side by side in one run.

Each rank trains a Qwen2-shaped model (FSDP1 or FSDP2, one unit per decoder layer plus the root) with plain Adam
(weight decay 0, TRL's default optimizer settings) on random token batches, at each learning rate. After every step,
interleaved: `dense` (the default complete sync's gather: every unit's local shards cast to bf16 and all-gathered,
`SyncConfig(delta=False)`'s flat gatherer; its output consumed and dropped, no engine) and `sparse` (each rank's
shards cast to bf16 and compared with its snapshot, `fsdp_sync.sync.sparse.Snapshot.diff`, then the patches all-gathered,
`gather_patches`). Reported per step: the changed fraction, bytes (dense: the full bf16 tensors; sparse: the patch
collectives' buffers: the low 16 bits of each index, a count per block of 2**16 elements, bf16 values, padding
included), seconds, and the snapshot's bytes per rank.

The engine side (applying patches in vLLM) is not part of these figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .common import wrap_fsdp

ENGINE = torch.bfloat16
LEARNING_RATES = (1e-6, 1e-5)


def _model(model_name: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import config_for

    from .shapes import CPU_SHAPES

    torch.manual_seed(0)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(config_for(CPU_SHAPES[model_name]), dtype=torch.float32).to(device)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab: int, step: int) -> None:
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    ids = torch.randint(0, vocab, (2, 64), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sparse_worker(rank: int, world_size: int, model_name: str, steps: int) -> list[dict[str, Any]]:
    from fsdp_sync.backend import detect_backend
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.memory import MemoryMeter
    from fsdp_sync.sync.patches import gather_patches
    from fsdp_sync.sync.sparse import Snapshot

    torch.set_num_threads(1)
    device = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for backend in ("fsdp1", "fsdp2"):
        for lr in LEARNING_RATES:
            model = _model(model_name, device)
            vocab = model.config.vocab_size
            wrapped = wrap_fsdp(model, backend, device)
            gatherer = make_gatherer(wrapped, detect_backend(wrapped), SyncConfig(delta=False), engine_dtype=ENGINE)
            specs = gatherer.specs()
            names = list(specs)
            numels = [specs[n].numel for n in names]
            dense_bytes = sum(numels) * ENGINE.itemsize
            snapshot = Snapshot(ENGINE)
            snapshot.take(gatherer.local_pieces(names))
            snapshot.commit()
            optimizer = torch.optim.Adam(wrapped.parameters(), lr=lr)
            meter = MemoryMeter(device)
            for step in range(steps):
                _train_step(wrapped, optimizer, vocab, step)
                timings: dict[str, float] = {}

                def dense() -> None:
                    for _ in gatherer.iter_full(meter):
                        pass

                def sparse() -> Any:
                    started = time.perf_counter()
                    patches = snapshot.diff(gatherer.local_pieces(names))
                    timings["diff"] = time.perf_counter() - started
                    joined = gather_patches(names, patches, [ENGINE] * len(names), numels, to_all=True)
                    snapshot.commit()
                    return joined

                order = ("dense", "sparse") if step % 2 == 0 else ("sparse", "dense")
                joined = None
                for method in order:
                    torch.distributed.barrier()
                    started = time.perf_counter()
                    if method == "dense":
                        dense()
                    else:
                        joined = sparse()
                    timings[method] = time.perf_counter() - started
                assert joined is not None
                rows.append({
                    "model": model_name, "backend": backend, "lr": lr, "step": step, "rank": rank,
                    "changed": sum(joined.totals), "numel": sum(numels), "dense_bytes": dense_bytes,
                    "sparse_bytes": joined.wire_bytes, "dense_s": timings["dense"], "sparse_s": timings["sparse"],
                    "diff_s": timings["diff"], "snapshot_bytes": snapshot.nbytes, "world_size": world_size,
                })  # fmt: skip
            del wrapped, model, optimizer, gatherer, snapshot
    return rows


def sparse_table(rows: list[dict[str, Any]]) -> str:
    """Per model, backend and learning rate (rank 0; steps after the first): medians and ratios."""
    out = [
        "| model | backend | lr | changed (median, range over steps) | bytes dense | bytes sparse (median) | "
        "dense / sparse bytes | dense ms | sparse ms (diff) | dense / sparse time | snapshot / rank |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["model"], r["backend"], r["lr"]) for r in rows if r["rank"] == 0}, key=str)
    for model, backend, lr in keys:
        mine = [r for r in rows if r["rank"] == 0 and (r["model"], r["backend"], r["lr"]) == (model, backend, lr)]
        later = [r for r in mine if r["step"] > 0] or mine
        fractions = [r["changed"] / r["numel"] for r in mine]
        sparse_bytes = statistics.median(r["sparse_bytes"] for r in later)
        dense_ms = statistics.median(r["dense_s"] for r in later) * 1e3
        sparse_ms = statistics.median(r["sparse_s"] for r in later) * 1e3
        diff_ms = statistics.median(r["diff_s"] for r in later) * 1e3
        dense_bytes = mine[0]["dense_bytes"]
        out.append(
            f"| {model} | {backend} | {lr:g} | {statistics.median(fractions):.2%} ({min(fractions):.2%}-"
            f"{max(fractions):.2%}) | {dense_bytes / 1e6:.1f} MB | {sparse_bytes / 1e6:.2f} MB | "
            f"{dense_bytes / max(1, sparse_bytes):.1f}x | {dense_ms:.0f} | {sparse_ms:.0f} ({diff_ms:.0f}) | "
            f"{dense_ms / sparse_ms:.2f}x | {mine[0]['snapshot_bytes'] / 1e6:.1f} MB |"
        )
    return "\n".join(out)
