"""Sparse syncs end to end: the whole sync, dense against sparse, into a real engine, after each real optimizer step,
side by side in one run.

Each of 2 gloo ranks trains a Qwen2-shaped model (FSDP2, one unit per decoder layer plus the root; random init from
its config) with plain Adam at each learning rate, and pushes into a real vLLM CPU engine: `server` (one vLLM server
process started with `FSDP_VLLM_SYNC_SPARSE=1`, the gloo backend; rank 0 sends) or `colocate` (an in-process engine
in each rank, its linear weights kept unpacked as `SyncConfig(sparse=True)` keeps them). After every step, in this
order: `sparse` (`WeightSync.sync()` with `SyncConfig(sparse=True)`, what a user gets: diff, patch collectives, the
patches written in place, engine modules over the density threshold whole; after a sync that went mostly whole, the
back-off's dense syncs, and the snapshot taken again after them, counted in) and `dense` (`policy.whole_next()`, then `sync()`, on the
same object: every tensor whole, as a sync without `sparse`; the snapshot it then takes for the next step is not
counted). Both land the same weights. Reported per step: the changed fraction, bytes (dense: the bf16 tensors;
sparse: the patches' encoded bytes plus what went whole), and seconds of each.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .common import server_writer, wrap_fsdp
from .sparse import LEARNING_RATES, _model, _train_step


def sparse_sync_worker(
    rank: int, world_size: int, model_name: str, model_dir: str, mode: str, steps: int, base_url: str | None, port: int
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.report import SparseFigures

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if mode == "colocate":
        from fsdp_sync.compat.vllm_patches import keep_cpu_linear_weights
        from fsdp_sync.writers import ColocateWriter

        from .cpu import _engine

        keep_cpu_linear_weights()
        writer: Any = ColocateWriter(_engine(model_dir))
    else:
        assert base_url is not None
        writer = server_writer(base_url, rank, port)
    rows: list[dict[str, Any]] = []
    for lr in LEARNING_RATES:
        model = _model(model_name, device)
        vocab = model.config.vocab_size
        wrapped = wrap_fsdp(model, "fsdp2", device)
        sync = build_sync(wrapped, writer, SyncConfig(sparse=True), device=device)
        first = sync.sync()
        assert first.complete
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=lr)
        for step in range(steps):
            _train_step(wrapped, optimizer, vocab, step)
            dist.barrier()
            sparse = sync.sync()
            dist.barrier()
            sync.policy.whole_next()
            dense = sync.sync()
            assert not dense.sparse and dense.bytes > 0, dense
            sparse_figures, dense_figures = sparse.figure(SparseFigures), dense.figure(SparseFigures)
            rows.append({
                "model": model_name, "mode": mode, "lr": lr, "step": step, "rank": rank, "world_size": world_size,
                "changed": sparse_figures.changed_elements, "patched": sparse_figures.diffed_elements, "patched_elements": sparse_figures.patched_elements, "patch_s": sparse_figures.patch_seconds,
                "whole_tensors": sparse.tensors, "dense_bytes": dense.bytes,
                "sparse_bytes": sparse.bytes + sparse_figures.patch_bytes, "dense_s": dense.seconds,
                "sparse_s": sparse.seconds + sparse_figures.snapshot_seconds, "sent_sparse": sparse.sparse, "snapshot_bytes": sparse_figures.snapshot_bytes,
                "snapshot_s": dense_figures.snapshot_seconds,
            })  # fmt: skip
        del sync, wrapped, model, optimizer
    return rows


def sparse_sync_table(rows: list[dict[str, Any]]) -> str:
    """Per model, mode and learning rate (rank 0's rows: the pushing rank in server mode): medians over the steps."""
    head = (
        "| model | mode | lr | steps (sparse) | changed (median, range) | bytes dense / sparse | dense sync s | "
        "sparse sync s (trainer side) | speed-up | snapshot MB/rank |"
    )
    lines = [head, "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["model"], r["mode"], r["lr"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for model, mode, lr in keys:
        sel = [r for r in rows if (r["model"], r["mode"], r["lr"]) == (model, mode, lr) and r["rank"] == 0]
        diffed = [r for r in sel if r["patched"]]
        frac = [r["changed"] / r["patched"] for r in diffed] or [0.0]
        ratio = statistics.median(r["dense_bytes"] / r["sparse_bytes"] for r in sel)
        dense_s = statistics.median(r["dense_s"] for r in sel)
        sparse_s = statistics.median(r["sparse_s"] for r in sel)
        patch_s = statistics.median(r["patch_s"] for r in sel)
        lines.append(
            f"| {model} | {mode} | {lr:g} | {len(sel)} ({sum(r['sent_sparse'] for r in sel)}) | "
            f"{statistics.median(frac):.2%} ({min(frac):.2%}-{max(frac):.2%}) | {ratio:.1f}x | {dense_s:.3f} | "
            f"{sparse_s:.3f} ({patch_s:.3f}) | {dense_s / sparse_s:.2f}x | {sel[0]['snapshot_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)
