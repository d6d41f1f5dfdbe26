"""TRL's async GRPO trainer: how long each weight sync takes, and how long the server's generation is paused for it,
with the mixin and with TRL's own sync, side by side in one run.

Per model: one real vLLM CPU server (gloo weight transfer), and the real `AsyncGRPOTrainer` with its rollout worker
generating on it, 2 gloo ranks under FSDP2 (`tests.support.async_job`), alternately:
- `ours`: `class Trainer(FSDPVLLMSyncMixin, AsyncGRPOTrainer)`: gathers, checks and bytes on the wire while the
  server generates; the server paused for the write alone (staged gloo rounds);
- `trl`: TRL 1.16's own `_sync_weight` (pause, barrier, `_streaming_iter`: one `full_tensor()` per parameter, in the
  trainer's dtype, resume), through a gloo stand-in for its NCCL client (`tests.support.stock_async`).
Each job syncs at train begin and after every step; the first sync of each job (cold: the handshake, and a complete
sync for ours) is reported apart from the rest. `sync` is the trainer's whole `_sync_weight` call as rank 0 sees it,
`paused` the time from the pause request to the resume answer (what the rollout worker sees).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["async_rows", "async_table"]

METHODS = ("ours", "trl")


def _job(model_dir: Path, out: Path, url: str, steps: int, stock: bool) -> dict[str, Any]:
    from tests.support.dist import free_port
    from tests.support.launch import launch_job

    args = ["--model-dir", str(model_dir), "--out-dir", str(out), "--server-url", url, "--group-port",
            str(free_port()), "--steps", str(steps), "--lr", "1e-3", *(["--stock"] if stock else [])]  # fmt: skip
    result = launch_job("tests.support.async_job", args, out, backend="fsdp2", timeout=1800)
    if result.returncode != 0 or not result.ranks or "fatal" in result.ranks[0]:
        raise RuntimeError(f"the {'trl' if stock else 'ours'} async job failed:\n{result.log[-4000:]}")
    return result.ranks[0]


def async_rows(models: list[str], steps: int, rounds: int) -> list[dict[str, Any]]:
    """Per model, `rounds` jobs of each method, alternating; one row per sync (rank 0)."""
    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync._demo.vllm_server import VLLMServerProcess

    from .shapes import CPU_SHAPES

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model_dir = build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name])
            with VLLMServerProcess(model_dir, Path(tmp) / f"{name}-server.log", readable_weights=False) as server:
                for round_index in range(rounds):
                    for method in METHODS:
                        out = Path(tmp) / f"{name}-{method}-{round_index}"
                        record = _job(model_dir, out, server.base_url, steps, stock=method == "trl")
                        reports = [r for r in record["syncs"] if r.get("ok")]
                        for index, (seconds, pause) in enumerate(zip(record["sync_seconds"], record["pauses"])):
                            sent = reports[index]["bytes"] if reports else record.get("stock_bytes", 0)
                            rows.append(
                                {"model": name, "method": method, "round": round_index, "sync": index,
                                 "seconds": seconds, "paused": pause[0] if pause else None, "bytes": sent}  # fmt: skip
                            )
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def async_table(rows: list[dict[str, Any]]) -> str:
    """Medians per model, method and phase (first sync of a job, later syncs), with TRL's over ours."""
    lines = [
        "| model | syncs | method | n | sync ms (median) | server paused ms (median) | MB per sync | sync trl/ours "
        "| paused trl/ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        for phase, pick in (("first", lambda r: r["sync"] == 0), ("later", lambda r: r["sync"] > 0)):
            medians: dict[str, tuple[float, float]] = {}
            for method in METHODS:
                chosen = [r for r in rows if r["model"] == model and r["method"] == method and pick(r)]
                seconds = _median([r["seconds"] for r in chosen])
                paused = _median([r["paused"] for r in chosen if r["paused"] is not None])
                medians[method] = (seconds, paused)
                sent = _median([r["bytes"] for r in chosen]) / 1e6
                ratio = ("", "")
                if method == "trl":
                    ours = medians["ours"]
                    ratio = (f"{seconds / ours[0]:.2f}x", f"{paused / ours[1]:.2f}x")
                lines.append(
                    f"| {model} | {phase} | {method} | {len(chosen)} | {seconds * 1e3:.1f} | {paused * 1e3:.1f} "
                    f"| {sent:.1f} | {ratio[0]} | {ratio[1]} |"
                )
    return "\n".join(lines)
