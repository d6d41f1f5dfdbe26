"""Where the time of the two GPU near misses of issue 51 goes: the device's own busy time against the wall time, per
step, from torch's profiler.

    python -m benchmarks.run profile [--reps 5]

Why: a sync or a kernel that runs at 1.5x or 2.4x its floor is bounded either by the host (the device idles between
launches: busy time well under the wall time) or by the device (busy time near the wall time: the kernels themselves
run under the copy rate). The two cases need different work, and only a trace tells them apart.

Profiled, one repetition after another (the first a warm-up):
- `sync`: the FSDP2 complete sync of Qwen2-1.5B on one GPU (the flat gatherer into the engine-layout buffers,
  `benchmarks.gpu`'s `ours-flat`); floor: one device-to-device copy of the same bytes.
- `extract`: sparse extraction of Qwen2-7B's bfloat16 tensors at 2% changed (`benchmarks.kernels`' kernel row);
  floor: 4 bytes an element at the copy rate.
Per row: the median wall time, the device's busy time (the union of every kernel's and copy's interval) and its share
of the wall, and the kernels that took most of it (median ms per repetition).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SHARE = 0.02


def _busy_ms(events: list[Any]) -> float:
    """The union of the device intervals of `events` (the profiler's device-side events), in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3  # the profiler's times are in microseconds


def _profiled(name: str, step: Callable[[], None], reps: int, floor_ms: float, prepare: Callable[[], None]) -> dict[str, Any]:
    """`step` after `prepare` (outside the timing), `reps` times after a warm-up: the wall time unprofiled, then the
    device's busy time and the top kernels under the profiler (which slows the host, not the device)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prepare()
    step()
    torch.cuda.synchronize()
    walls, busies = [], []
    kernels: dict[str, list[float]] = {}
    for _ in range(reps):
        prepare()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    for _ in range(reps):
        prepare()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busies.append(_busy_ms(device))
        per_kernel: dict[str, float] = {}
        for e in device:
            key = e.name[:60]
            per_kernel[key] = per_kernel.get(key, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        for kernel, ms in per_kernel.items():
            kernels.setdefault(kernel, []).append(ms)
    top = sorted(((statistics.median(v), k) for k, v in kernels.items()), reverse=True)[:4]
    return {"what": name, "wall_ms": statistics.median(walls), "busy_ms": statistics.median(busies),
            "floor_ms": floor_ms, "kernels": [[k, ms] for ms, k in top], "reps": reps}  # fmt: skip


def _sync_row(reps: int, rate: float) -> dict[str, Any]:
    from fsdp_sync.backend import detect_backend
    from fsdp_sync.compat.layout import IdentityLayout
    from fsdp_sync.compat.names import NameRules
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.sync.pipeline import WeightSync
    from fsdp_sync.sync.stream import build_plan

    from .buffers import FusedBuffersWriter
    from .common import wrap_fsdp
    from .gpu import _build

    device = torch.device("cuda", torch.cuda.current_device())
    wrapped = wrap_fsdp(_build("qwen2-1.5b", device), "fsdp2", device)
    with torch.no_grad():
        wrapped(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device))
    gatherer = make_gatherer(wrapped, detect_backend(wrapped), SyncConfig(fsdp2_strategy="flat"),
                             engine_dtype=torch.bfloat16, compute_device=device)  # fmt: skip
    plan = build_plan(gatherer, NameRules(), IdentityLayout())
    writer = FusedBuffersWriter({t.name: t.spec for t in plan.tensors}, dtype=torch.bfloat16, device=device)
    sync = WeightSync(gatherer, writer.copying("batched"), backend="fsdp2", device=device)
    row = _profiled("sync: qwen2-1.5b fsdp2 flat, complete", sync.sync, reps, 2 * writer.nbytes / rate * 1e3, lambda: None)
    row["tensors"] = len(plan.tensors)
    return row


def _extract_row(reps: int, rate: float) -> dict[str, Any]:
    from fsdp_sync.gather.base import Piece
    from fsdp_sync.sync.sparse import Snapshot

    from .kernels import _random, _shapes

    device = torch.device("cuda", torch.cuda.current_device())
    shapes = _shapes("qwen2-7b")
    values = [_random(s, torch.bfloat16, device, k).reshape(-1) for k, s in enumerate(shapes.values())]
    pieces = [Piece(n, v, 0) for n, v in zip(shapes, values, strict=True)]
    numel = sum(v.numel() for v in values)
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take(pieces)
    generator = torch.Generator(device=device).manual_seed(1)

    def change() -> None:  # an optimizer step's worth of changes, outside the timing
        for v in values:
            hit = torch.rand(v.numel(), generator=generator, device=device) < SHARE
            v[hit] = (v[hit].float() * 1.5 + 0.25).to(torch.bfloat16)

    row = _profiled(f"extract: qwen2-7b bf16, {SHARE:.0%} changed", lambda: snapshot.diff(pieces), reps,
                    numel * 4 / rate * 1e3, change)  # fmt: skip
    row["tensors"] = len(pieces)
    return row


def profile_worker(rank: int, world_size: int, reps: int) -> list[dict[str, Any]]:
    """The rows, in a process of its own with a process group of one (FSDP's wrappers need one)."""
    from .delta import _copy_rate

    device = torch.device("cuda", torch.cuda.current_device())
    rate = _copy_rate(device)
    rows = [_sync_row(reps, rate)]
    torch.cuda.empty_cache()
    rows.append(_extract_row(reps, rate))
    return rows


def profile_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| what | tensors | wall ms | device busy ms | busy / wall | floor ms | wall / floor | busy / floor | "
        "top kernel | top kernel ms | top kernel / floor | next kernels, ms each (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        (top, top_ms), *others = r["kernels"]
        rest = "; ".join(f"`{name}` {ms:.2f}" for name, ms in others)
        lines.append(
            f"| {r['what']} | {r['tensors']} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | "
            f"{r['busy_ms'] / r['wall_ms']:.2f} | {r['floor_ms']:.2f} | {r['wall_ms'] / r['floor_ms']:.2f} | "
            f"{r['busy_ms'] / r['floor_ms']:.2f} | `{top}` | {top_ms:.2f} | {top_ms / r['floor_ms']:.2f} | {rest} |"
        )
    return "\n".join(lines)
