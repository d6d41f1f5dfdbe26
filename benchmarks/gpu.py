"""GPU benchmark: FSDP1/FSDP2 over NCCL, bf16 1.5B- and 7B-shaped Qwen2 models, pushing into engine-layout buffers.

Runs on any number of GPUs (one process each). Per model and backend: TRL 1.16's path (its own gather code, one
engine copy per tensor), each of our strategies, and the floor: one flat device-to-device copy of the same bytes,
measured in the same run. With `check`, every method's result is compared bit for bit with the full weights.

The engine's copies (`copies.CopyPlan`): the default strategy (`ours-flat`) writes batched, one `_foreach_copy_` per
dtype pair; `ours-flat-loop` is the same sync with one `copy_` per tensor (as vLLM's loaders copy, and as every row
did before), `ours-flat-graph` replays a CUDA graph of the copies once their addresses repeat; the other strategies
and TRL's path copy per tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .common import Measurement, answer_rounds_locally, measure, wrap_fsdp

OURS = {"fsdp1": ["flat", "unit", "root"], "fsdp2": ["flat", "unit", "param"]}


def _config(backend: str, strategy: str):
    from fsdp_sync.config import SyncConfig

    return SyncConfig(fsdp1_strategy=strategy) if backend == "fsdp1" else SyncConfig(fsdp2_strategy=strategy)


def _build(model_name: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import config_for

    from .shapes import GPU_SHAPES

    torch.manual_seed(0)  # same weights on every rank
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config_for(GPU_SHAPES[model_name]), dtype=torch.bfloat16)


def _measure_backend(
    rank: int, world_size: int, model_name: str, reps: int, check: bool, backend: str, device: torch.device
) -> list[dict[str, Any]]:
    """TRL's path, our strategies and the floor for one backend, interleaved over `reps` repetitions."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_sync.compat.layout import IdentityLayout
    from fsdp_sync.compat.names import NameRules, canonical_name
    from fsdp_sync.backend import detect_backend
    from fsdp_sync.gather import make_gatherer
    from fsdp_sync.sync.pipeline import WeightSync
    from fsdp_sync.sync.stream import build_plan

    from .buffers import FusedBuffersWriter
    from .trl_path import trl_sync

    rows: list[dict[str, Any]] = []
    model = _build(model_name, device)
    held_by_trl = model
    wrapped = wrap_fsdp(model, backend, device)
    # NOTE: one forward first, as training runs before its syncs: it initialises FSDP1 from the true root. Without it
    # TRL's own child-first walk (the `trl` method, measured first) marks nested units as roots (the seed bug), and
    # the per-unit summon measured after it fails.
    with torch.no_grad():
        wrapped(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device))
    detected = detect_backend(wrapped)
    gatherers = {s: make_gatherer(wrapped, detected, _config(backend, s), engine_dtype=torch.bfloat16,
                                  compute_device=device) for s in OURS[backend]}
    plan = build_plan(gatherers[OURS[backend][0]], NameRules(), IdentityLayout())
    writer = FusedBuffersWriter({t.name: t.spec for t in plan.tensors}, dtype=torch.bfloat16, device=device)
    writers = {copies: writer.copying(copies) for copies in ("batched", "graph")}

    def flat() -> Any:
        return make_gatherer(wrapped, detected, _config(backend, "flat"), engine_dtype=torch.bfloat16,
                             compute_device=device)  # fmt: skip

    syncs = {s: WeightSync(g, writers["batched"] if s == "flat" else writer, backend=backend, device=device)
             for s, g in gatherers.items()}  # fmt: skip
    # The default without its status rounds (what the failure protocol costs, docs/failures.md):
    # benchmark-side only, the same sync with its coordinator's rounds answered locally.
    syncs["flat-norounds"] = WeightSync(flat(), writers["batched"], backend=backend, device=device)
    answer_rounds_locally(syncs["flat-norounds"].coordinator)
    syncs["flat-loop"] = WeightSync(flat(), writer, backend=backend, device=device)
    syncs["flat-graph"] = WeightSync(flat(), writers["graph"], backend=backend, device=device)
    expected = None
    if check:
        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
        expected = {canonical_name(k): v for k, v in full.items() if canonical_name(k) in writer.slots}
        assert len(expected) == len(writer.slots), "the reference must cover every engine block"
    flat_src = torch.empty(writer.nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    def run_floor() -> tuple[int, int]:
        flat_dst.copy_(flat_src)
        return 1, writer.nbytes

    def run_trl() -> tuple[int, int]:
        return trl_sync(held_by_trl, backend, writer.write, device)

    def run_ours(strategy: str) -> tuple[int, int]:
        report = syncs[strategy].sync()
        return report.tensors, report.bytes

    methods = {"trl": run_trl, "floor": run_floor}
    missing = _trl_missing()
    if missing:
        # NOTE: a GPU machine without TRL (its image has none) still measures ours against the floor.
        del methods["trl"]
        rows.append({"model": model_name, "backend": backend, "method": "trl", "rank": rank, "skipped": missing})
    if world_size > 1:
        # With several ranks the floor is the all-gather of the same bytes: what each rank must receive, at the
        # collective's own bandwidth, measured here.
        shard = torch.empty(writer.nbytes // world_size, dtype=torch.uint8, device=device)
        gathered = torch.empty(shard.numel() * world_size, dtype=torch.uint8, device=device)

        def run_allgather_floor() -> tuple[int, int]:
            dist.all_gather_into_tensor(gathered, shard)
            return 1, gathered.numel()

        methods["floor-allgather"] = run_allgather_floor
    methods.update({f"ours-{s}": (lambda s=s: run_ours(s)) for s in syncs})
    for method in methods:  # warm-up (allocator, NCCL communicators), not measured
        methods[method]()
    for rep in range(reps):
        order = list(methods)
        order = order[rep % len(order):] + order[: rep % len(order)]
        for method in order:
            if expected is not None:
                for buffer in writer.buffers.values():
                    buffer.zero_()
            seconds, tensors, nbytes, peak, source = measure(methods[method], device)
            row = Measurement(model_name, backend, method, rep, seconds, tensors, nbytes, peak, source,
                              world_size, rank).row()
            if expected is not None and method != "floor":
                bad = writer.mismatches(expected)
                row["mismatches"] = len(bad)
                row["mismatch_names"] = bad[:8]
            rows.append(row)
    for strategy, sync in syncs.items():
        rows.append({"model": model_name, "backend": backend, "method": f"ours-{strategy}",
                     "accounted_peak_bytes": sync.meter.accounted_peak_bytes, "rank": rank})
    rows.append({"model": model_name, "backend": backend, "method": "ours-flat-graph", "rank": rank,
                 "graph_replays": writers["graph"].copies.replays})  # fmt: skip
    return rows


def _trl_missing() -> str | None:
    """Why TRL's path cannot run here (its import's error), or None."""
    try:
        import trl.generation.vllm_generation  # noqa: F401
    except ImportError as e:
        return f"TRL's path not measured: {type(e).__name__}: {e}"
    return None


def gpu_worker(rank: int, world_size: int, model_name: str, reps: int, check: bool) -> list[dict[str, Any]]:
    """Both backends, one after the other (each builds, measures and frees its own model)."""
    # (CPU only for a smoke test of this code with gloo; figures are from GPUs.)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for backend in ("fsdp1", "fsdp2"):
        rows.extend(_measure_backend(rank, world_size, model_name, reps, check, backend, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    return rows
