"""Delta syncs against complete ones and against TRL 1.16's LoRA path, per sync: time and bytes.

A LoRA adapter (r=16) on q_proj/v_proj, or on every linear layer, on a Qwen2-shaped model wrapped with FSDP1 or
FSDP2 (one unit per decoder layer, plus the root). Between repetitions the adapters change (every LoRA weight is
scaled, on every rank, as an optimizer step would change it), so every sync has new merged weights to send.

Methods, interleaved: `ours-complete` (SyncConfig(delta=False): every tensor), `ours-delta` (the default: what can
change, with the check of the skipped weights; its check time is reported apart), `ours-delta-nocheck`
(delta_check=False), and `trl` (TRL 1.16's LoRA path: `merge_adapter()`, its own FSDP2 walk with one engine call per
tensor, `unmerge_adapter()`; FSDP2 only: under FSDP1 it merges into shards and fails, see docs/design.md). The engine
is the real vLLM CPU engine in each rank (`cpu`), or the engine-layout buffers of the GPU benchmark (`buffers`,
filled batched unless `--copies` says otherwise; `copies.CopyPlan`).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Measurement, measure

TARGETS = {"qv": ["q_proj", "v_proj"], "all": "all-linear"}


def _wrap(peft: torch.nn.Module, backend: str, device: torch.device) -> torch.nn.Module:
    import torch.distributed as dist

    layers = peft.base_model.model.model.layers
    match backend:
        case "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            device_id = torch.device("cpu") if device.type == "cpu" else device
            return FSDP(peft, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device_id,
                        use_orig_params=True)  # fmt: skip
        case _:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(peft, mesh=mesh)
            return peft


def _peft_model(base: torch.nn.Module, targets: Any) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # Adapters in the base dtype (FSDP1 flattens one dtype per unit; PEFT would upcast them to fp32).
    config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
    peft = get_peft_model(base, config, autocast_adapter_dtype=False)
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: no delta at all
                p.copy_((torch.randn(p.shape, generator=generator) * 0.01).to(p.dtype))
    return peft


def _step(model: torch.nn.Module) -> None:
    """What an optimizer step does to the weights a sync must send: the adapters change (on every rank alike)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(1.01)


def _trl_lora(wrapped: torch.nn.Module, push_one: Any, device: torch.device) -> tuple[int, int]:
    from .trl_path import trl_sync

    wrapped.merge_adapter()
    try:
        return trl_sync(wrapped, "fsdp2", push_one, device)
    finally:
        wrapped.unmerge_adapter()


def delta_worker(
    rank: int, world_size: int, model_name: str, model_dir: str | None, reps: int, engine: str, copies: str = "batched"
) -> list[dict[str, Any]]:
    from fsdp_sync.compat.manifest import TensorSpec

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if engine == "cpu":
        from fsdp_sync.compat.engine_api import engine_handle
        from fsdp_sync.writers import ColocateWriter

        from .cpu import _engine

        llm = _engine(model_dir)
        writer: Any = ColocateWriter(llm)
        handle = engine_handle(llm)

        def push_one(items: Any) -> None:
            handle.push(iter(items))
    rows: list[dict[str, Any]] = []
    for targets in TARGETS:
        for backend in ("fsdp1", "fsdp2"):
            base = _base_model(model_name, model_dir, device)
            if engine == "buffers":
                from .buffers import FusedBuffersWriter

                specs = {n: TensorSpec(tuple(p.shape), p.dtype) for n, p in base.named_parameters()}
                # Ours copy as `copies` says (`copies.CopyPlan`); TRL's path one engine call per tensor, as into vLLM.
                writer = FusedBuffersWriter(specs, dtype=torch.bfloat16, device=device, copies=copies)
                push_one = writer.copying("loop").write
            wrapped = _wrap(_peft_model(base, TARGETS[targets]), backend, device)
            rows += _measure(wrapped, writer, push_one, backend, targets, model_name, reps, rank, world_size, device)
            del base, wrapped
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _measure(
    wrapped: torch.nn.Module,
    writer: Any,
    push_one: Any,
    backend: str,
    targets: str,
    model_name: str,
    reps: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """The methods on one wrapped PEFT model, interleaved over `reps` repetitions."""
    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.report import DeltaFigures

    syncs = {
        "ours-complete": build_sync(wrapped, writer, SyncConfig(delta=False), device=device),
        "ours-delta": build_sync(wrapped, writer, SyncConfig(), device=device),
        "ours-delta-nocheck": build_sync(wrapped, writer, SyncConfig(delta_check=False), device=device),
    }
    for sync in syncs.values():
        sync.sync()  # the first sync of each is complete
    check_seconds: list[float] = []
    skipped_bytes: list[int] = []

    def run(name: str) -> tuple[int, int]:
        report = syncs[name].sync()
        if name == "ours-delta":
            figures = report.figure(DeltaFigures)
            check_seconds.append(figures.check_seconds)
            skipped_bytes.append(figures.skipped_bytes)
        return report.tensors, report.bytes

    methods = {name: (lambda n=name: run(n)) for name in syncs}
    if backend == "fsdp2":
        methods["trl"] = lambda: _trl_lora(wrapped, push_one, device)
    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        order = list(methods)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for method in order:
            _step(wrapped)
            seconds, tensors, nbytes, peak, source = measure(methods[method], device)
            rows.append(Measurement(model_name, backend, f"{targets}/{method}", rep, seconds, tensors, nbytes, peak,
                                    source, world_size, rank).row())  # fmt: skip
    rows.append({"model": model_name, "backend": backend, "method": f"{targets}/check", "rank": rank,
                 "check_seconds": check_seconds, "skipped_bytes": skipped_bytes,
                 "copy_bytes_per_s": _copy_rate(device)})  # fmt: skip
    return rows


def _copy_rate(device: torch.device, nbytes: int = 2**31, reps: int = 7) -> float | None:
    """Bytes moved per second (read plus written) by one device-to-device copy of `nbytes`, median of `reps`: the
    floors' rate (a check reads each skipped byte once: bytes / rate; a push copies each byte: 2 x bytes / rate)."""
    import statistics
    import time

    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def _base_model(model_name: str, model_dir: str | None, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    from fsdp_sync._demo.models import config_for

    from .shapes import GPU_SHAPES

    torch.manual_seed(0)  # same weights on every rank
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config_for(GPU_SHAPES[model_name]), dtype=torch.bfloat16)


def delta_table(rows: list[dict[str, Any]]) -> str:
    """Per model, backend and adapter: median ms and bytes of each method (rank 0), and the ratios that matter."""
    import statistics

    timed = [r for r in rows if "seconds" in r and r["rank"] == 0]
    checks = {(r["model"], r["backend"], r["method"].split("/")[0]): r
              for r in rows if r.get("method", "").endswith("/check") and r["rank"] == 0}  # fmt: skip
    keys = sorted({(r["model"], r["backend"], r["method"].split("/")[0]) for r in timed})
    lines = [
        "| model | backend | LoRA on | complete ms | delta ms | delta, no check ms | check ms | TRL ms | complete MB | "
        "delta MB | bytes: complete / delta | time: complete / delta | time: TRL / delta | complete x floor | "
        "delta x floor | check x floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, backend, targets in keys:
        def med(method: str, field: str = "seconds") -> float | None:
            values = [r[field] for r in timed if (r["model"], r["backend"], r["method"]) == (model, backend,
                                                                                               f"{targets}/{method}")]
            return statistics.median(values) if values else None

        complete, delta, nocheck, trl = (med(m) for m in ("ours-complete", "ours-delta", "ours-delta-nocheck", "trl"))
        cbytes, dbytes = med("ours-complete", "bytes"), med("ours-delta", "bytes")
        facts = checks.get((model, backend, targets), {})
        check = statistics.median(facts["check_seconds"]) if facts.get("check_seconds") else 0
        skipped = statistics.median(facts["skipped_bytes"]) if facts.get("skipped_bytes") else 0
        rate = facts.get("copy_bytes_per_s")
        # Floors at the measured copy rate: a push copies each byte it sends (2 x bytes / rate), the check reads each
        # skipped byte once (bytes / rate). The merge's FLOPs (2 r (in + out) per adapted weight, r = 16) are below
        # 0.01 ms on this GPU and left out.
        floors = (2 * cbytes / rate, 2 * dbytes / rate + skipped / rate, skipped / rate) if rate else None

        def over(value: float, floor: float) -> str:
            return f"{value / floor:.1f}" if floor else "n/a"

        ratios = (
            " | ".join(over(v, f) for v, f in zip((complete, delta, check), floors, strict=True))
            if floors
            else "n/a | n/a | n/a"
        )
        label = {"qv": "q_proj, v_proj", "all": "all linear"}[targets]
        lines.append(
            f"| {model} | {backend} | {label} | {complete * 1e3:.1f} | {delta * 1e3:.1f} | {nocheck * 1e3:.1f} | "
            f"{check * 1e3:.1f} | {f'{trl * 1e3:.1f}' if trl else 'n/a'} | {cbytes / 1e6:.1f} | {dbytes / 1e6:.1f} | "
            f"{cbytes / dbytes:.2f} | {complete / delta:.2f} | {f'{trl / delta:.2f}' if trl else 'n/a'} | {ratios} |"
        )
    return "\n".join(lines)
