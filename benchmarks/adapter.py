"""Adapter syncs beside merged ones, per sync: time and bytes, on the same model, LoRA config and engine.

A LoRA adapter (r=16, alpha 32) on q_proj/v_proj of a Qwen2-shaped model wrapped with FSDP1 or FSDP2 (one unit per
decoder layer, plus the root), 2 gloo ranks, the real vLLM CPU engine in each rank, started with LoRA enabled.
Between repetitions the adapters change (every LoRA weight scaled, as an optimizer step would change it).

Methods, interleaved: `merged-complete` (SyncConfig(adapter=False, delta=False): the adapter merged into its base
weights, every engine tensor pushed), `merged-delta` (SyncConfig(adapter=False): what can change, with the check of
the skipped weights), `adapter` (SyncConfig(adapter=True): only lora_A/lora_B, into the engine's LoRA manager).

NOTE: the adapter sync runs first (its base check reads the engine's checkpoint once, before merged syncs write
merged weights into the engine); the merged syncs then write the engine's base weights, which changes nothing of
what is timed here (no generation runs).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Measurement, measure
from .delta import _step, _wrap


def adapter_worker(rank: int, world_size: int, model_name: str, model_dir: str, reps: int) -> list[dict[str, Any]]:
    import os

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.writers import ColocateWriter

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(
        model=model_dir,
        max_model_len=128,
        distributed_executor_backend="external_launcher",
        seed=rank,
        max_num_batched_tokens=4096,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        enable_lora=True,
        max_lora_rank=16,
        max_loras=1,
    )
    writer = ColocateWriter(llm)
    device = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for backend in ("fsdp1", "fsdp2"):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        peft = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.01)
        wrapped = _wrap(peft, backend, device)
        syncs = {
            "adapter": build_sync(wrapped, writer, SyncConfig(adapter=True), device=device),
            "merged-complete": build_sync(wrapped, writer, SyncConfig(adapter=False, delta=False), device=device),
            "merged-delta": build_sync(wrapped, writer, SyncConfig(adapter=False), device=device),
        }
        for sync in syncs.values():
            sync.sync()  # the adapter's base check; the merged syncs' first, complete ones

        def run(name: str) -> tuple[int, int]:
            report = syncs[name].sync()
            return report.tensors, report.bytes

        for rep in range(reps):
            order = list(syncs)
            order = order[rep % len(order):] + order[: rep % len(order)]
            for method in order:
                _step(wrapped)
                seconds, tensors, nbytes, peak, source = measure(lambda m=method: run(m), device)
                rows.append(Measurement(model_name, backend, f"qv/{method}", rep, seconds, tensors, nbytes, peak,
                                        source, world_size, rank).row())  # fmt: skip
        del wrapped, peft, base
    return rows


def adapter_table(rows: list[dict[str, Any]]) -> str:
    """Per model and backend: median ms and MB per sync of each method (rank 0), and the adapter's ratios."""
    import statistics

    timed = [r for r in rows if "seconds" in r and r["rank"] == 0]
    keys = sorted({(r["model"], r["backend"]) for r in timed})
    lines = [
        "| model | backend | LoRA on | merged complete ms | merged delta ms | adapter ms | merged complete MB | "
        "merged delta MB | adapter MB | bytes: delta / adapter | time: delta / adapter |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, backend in keys:
        def med(method: str, field: str = "seconds") -> float:
            values = [r[field] for r in timed if (r["model"], r["backend"], r["method"]) == (model, backend, f"qv/{method}")]
            return statistics.median(values)

        complete, delta, adapter = (med(m) for m in ("merged-complete", "merged-delta", "adapter"))
        cbytes, dbytes, abytes = (med(m, "bytes") for m in ("merged-complete", "merged-delta", "adapter"))
        lines.append(
            f"| {model} | {backend} | q_proj, v_proj (r=16) | {complete * 1e3:.1f} | {delta * 1e3:.1f} | "
            f"{adapter * 1e3:.1f} | {cbytes / 1e6:.2f} | {dbytes / 1e6:.2f} | {abytes / 1e6:.2f} | "
            f"{dbytes / abytes:.1f} | {delta / adapter:.1f} |"
        )
    return "\n".join(lines)
