"""Sparse delta syncs (`fsdp_sync.sync.sparse`, `fsdp_sync.sync.patches`) on real sharded models, 2 gloo ranks: every rank's pieces are disjoint and
cover each full tensor, and the joined patches turn the weights last pushed into the new ones cast to the engine
dtype, bit for bit, after real optimizer steps; FSDP1 (original and flat parameters), FSDP2 and DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.backend import detect_backend
from fsdp_sync.config import SyncConfig
from fsdp_sync.gather import make_gatherer
from fsdp_sync.memory import MemoryMeter
from fsdp_sync.sync.patches import gather_patches
from fsdp_sync.sync.snapshot import Snapshot
from tests.support.dist import run_distributed

from .models import tiny_lm, train_step, wrap
from .pieces_check import held_mismatches

ENGINE = torch.bfloat16


def _full(gatherer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every full tensor cast to the engine dtype (what a dense sync would push)."""
    return {n: t.to(ENGINE, copy=True).reshape(-1) for n, t in gatherer.iter_full(MemoryMeter(torch.device("cpu")))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def sparse_scenario(rank: int, world_size: int, backend: str, use_orig_params: bool) -> dict:
    # NOTE: vocab 257 and 3 layers: shards that split a parameter unevenly and pieces that start mid-tensor.
    model = tiny_lm(layers=3, vocab=257)
    wrapped = wrap(model, backend, world_size, use_orig_params=use_orig_params)
    gatherer = make_gatherer(wrapped, detect_backend(wrapped), SyncConfig())
    names = list(gatherer.specs())
    numel = {n: s.numel for n, s in gatherer.specs().items()}
    pieces = list(gatherer.local_pieces(names))
    held = torch.tensor([sum(p.values.numel() for p in pieces if p.name == n) for n in names])
    dist.all_reduce(held)
    # The same pieces laid out once (adapter syncs), read at each step below.
    laid_out = gatherer.held_pieces(names)
    snapshot = Snapshot(ENGINE)
    snapshot.take(gatherer.local_pieces(names))
    snapshot.commit()
    pushed = _full(gatherer)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)
    results = []
    for step in range(3):
        train_step(wrapped, optimizer, seed=step)
        new = _full(gatherer)
        patches = snapshot.diff(gatherer.local_pieces(names))
        dtypes, numels = [ENGINE] * len(names), [numel[n] for n in names]
        everywhere = gather_patches(names, patches, dtypes, numels, to_all=True)
        at_zero = gather_patches(names, patches, dtypes, numels, to_all=False).patches
        totals, joined = everywhere.totals, everywhere.patches
        snapshot.commit()
        changed = {n: int((_bits(new[n]) != _bits(pushed[n])).sum()) for n in names}
        rebuilt = {}
        for n in names:
            t = pushed[n].clone()
            if n in joined:
                t[joined[n].indices] = joined[n].values
            rebuilt[n] = t
        if step == 2 and backend == "fsdp1":
            # A unit's shard moved to other storage (FSDP1 keeps it in one; the held views must not read stale).
            flat = wrapped.module.model.layers[0]._flat_param
            flat.data = flat.data.clone()
            flat.data.mul_(2)
        results.append({
            "held": held_mismatches(gatherer, laid_out, names),
            "exact": [n for n in names if not torch.equal(_bits(rebuilt[n]), _bits(new[n]))],
            "counts": totals == [changed[n] for n in names],
            "changed": sum(changed.values()),
            "numel": sum(numel.values()),
            "rank0_only": (sorted(at_zero) == sorted(joined)) if rank == 0 else at_zero == {},
            "same_at_zero": rank != 0 or all(torch.equal(at_zero[n].indices, joined[n].indices) for n in joined),
            # 2 bytes of index and 2 of value per change, padded to the longest rank's part, plus 4 bytes per block
            # of 2**16 elements per rank of each changed tensor.
            "wire": 0 < everywhere.wire_bytes <= 2 * (4 * sum(changed.values()) + 4 * len(names) * (1 + max(numel.values()) // 2**16)),
        })  # fmt: skip
        pushed = new
    return {"cover": held.tolist() == [numel[n] for n in names], "steps": results}


@pytest.mark.parametrize(
    "backend,use_orig_params", [("fsdp1", True), ("fsdp1", False), ("fsdp2", True), ("ddp", True)]
)
def test_joined_patches_rebuild_the_new_weights_bit_for_bit(backend: str, use_orig_params: bool) -> None:
    for r in run_distributed(sparse_scenario, backend, use_orig_params):
        assert r["cover"], "every element of every tensor must be in exactly one rank's piece"
        for step in r["steps"]:
            assert step["exact"] == [], f"weights not rebuilt exactly from the patches: {step['exact']}"
            assert step["held"] == [], f"held pieces differ from the listed ones: {step['held']}"
            assert step["counts"], "the joined counts must equal the changed elements of the full tensors"
            assert 0 < step["changed"] < step["numel"], step  # a real step changes some, not all, bf16 values
            assert step["rank0_only"] and step["same_at_zero"], step
            assert step["wire"], step
