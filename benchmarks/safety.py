"""Cost of the opt-in safety checks on the CPU colocate setup: 2 gloo ranks, a real vLLM CPU engine in each, FSDP2
and FSDP1 with the default flat strategy, after one training step.

Methods, interleaved over the repetitions: `ours-flat` (the default sync), `ours-flat+check_finite` (every rank
scans its own shards for NaN/Inf before the gather), `ours-flat+verify` (sha256 of every sent byte trainer-side, the
engine's own digests read back and compared). The engine keeps its linear weights readable (the test-side patch), so
the engine hashes every weight, as an engine that does not repack them (GPU) would.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Measurement, measure, wrap_fsdp
from .cpu import _engine, _train_step

VARIANTS = {"ours-flat": {}, "ours-flat+check_finite": {"check_finite": True}, "ours-flat+verify": {"verify": True}}


def safety_worker(rank: int, world_size: int, model_name: str, model_dir: str, reps: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from fsdp_sync.backend import detect_backend
    from fsdp_sync.compat.names import NameRules
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.sync.pipeline import WeightSync
    from fsdp_sync._demo.engine import keep_engine_weights_readable
    from fsdp_sync.writers import ColocateWriter

    keep_engine_weights_readable()
    llm = _engine(model_dir)
    writer = ColocateWriter(llm)
    device = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for backend in ("fsdp1", "fsdp2"):
        wrapped = wrap_fsdp(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), backend, device)
        _train_step(wrapped)
        detected = detect_backend(wrapped)
        gatherer = make_gatherer(wrapped, detected, SyncConfig(), engine_dtype=writer.engine_dtype)
        syncs = {
            name: WeightSync(gatherer, writer, SyncConfig(delta=False, **options), rules=NameRules(), backend=backend)
            for name, options in VARIANTS.items()
        }
        verify_seconds: list[float] = []

        def run(name: str) -> tuple[int, int]:
            report = syncs[name].sync()
            if report.verified is not None:
                verify_seconds.append(report.verify_seconds)
                assert report.unverifiable == 0 and report.verified > 0, report
            return report.tensors, report.bytes

        for rep in range(reps):
            order = list(VARIANTS)
            order = order[rep % len(order):] + order[: rep % len(order)]
            for name in order:
                seconds, tensors, nbytes, peak, source = measure(lambda n=name: run(n), device)
                rows.append(
                    Measurement(model_name, backend, name, rep, seconds, tensors, nbytes, peak, source, world_size,
                                rank).row()  # fmt: skip
                )
        rows.append({"model": model_name, "backend": backend, "method": "verify-digests", "rank": rank,
                     "verify_seconds": verify_seconds})  # fmt: skip
    return rows
