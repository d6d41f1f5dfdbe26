"""One entry point for the sync benchmarks.

    python -m benchmarks.run cpu [--reps 5] [--models qwen2-36m,qwen2-150m]
    python -m benchmarks.run server [--reps 5] [--models qwen2-36m,qwen2-150m]   (starts a vLLM CPU server per model)
    python -m benchmarks.run safety [--reps 5] [--models qwen2-36m,qwen2-150m]   (cost of check_finite and verify)
    python -m benchmarks.run adapter [--reps 5] [--models ...] [--engine cpu|buffers]   (adapter syncs vs merged
        complete and delta; `buffers`: the GPU engine stand-in with LoRA slots, e.g. `--models qwen2-7b`)
    python -m benchmarks.run delta [--reps 5] [--models ...] [--engine cpu|buffers] [--copies loop|batched|graph]
        (delta vs complete vs TRL LoRA)
    python -m benchmarks.run sparse [--reps 6] [--models ...]   (bf16 elements changed per Adam step; sparse vs dense)
    python -m benchmarks.run sparse-sync [--steps 5] [--models ...] [--modes server,colocate]   (whole syncs into vLLM)
    python -m benchmarks.run gpu [--reps 5] [--models qwen2-1.5b,qwen2-7b]   (one process per visible GPU; on CPU
        ranks, e.g. `--models qwen2-layout --world-size 1`, it writes gpu-cpu.*: the host work alone)
    python -m benchmarks.run kernels [--reps 5] [--models qwen2-7b] [--sources bfloat16,float32] [--sweep]   (the check
        and sparse extraction alone, against their floors; on CPU ranks only under TRITON_INTERPRET=1, tiny shapes)
    python -m benchmarks.run gpu-suite   (what a GPU session runs: gpu --check, delta --engine buffers, kernels,
        adapter --engine buffers)
    python -m benchmarks.run profile [--reps 5]   (GPU: the device's busy time against the wall time of the FSDP2
        1.5B complete sync and of sparse extraction at 7B, from torch's profiler)
    python -m benchmarks.run async [--models qwen2-36m] [--steps 4] [--rounds 2]   (TRL's AsyncGRPOTrainer on a vLLM CPU
        server: each sync and the server's pause, the mixin against TRL's own sync)
    python -m benchmarks.run report [--results benchmarks/results]

Each writes `<results>/<kind>.json` (raw rows), `<kind>.md` (table) and `<kind>.png` (time and peak memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .report import plot, summarize, table

RESULTS = Path(__file__).parent / "results"


def _save(out: Path, kind: str, machine: str, rows: list[dict], render: Callable[[list[dict]], str]) -> None:
    """`<kind>.json` (the raw rows, the machine, the date) and `<kind>.md` (its table) under `out`; prints the table.

    NOTE: the date travels with the figures, so that a table quoted in the docs says when and where it was measured.
    """
    out.mkdir(parents=True, exist_ok=True)
    measured = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    (out / f"{kind}.json").write_text(json.dumps({"machine": machine, "measured": measured, "rows": rows}, indent=1))
    text = f"{_header(measured, machine)}\n\n{render(rows)}\n"
    (out / f"{kind}.md").write_text(text)
    print(text)


def _header(measured: str | None, machine: str) -> str:
    return f"Measured {measured}. Machine: {machine}" if measured else f"Machine: {machine}"


def _write(kind: str, rows: list[dict], out: Path, machine: str) -> None:
    summary = summarize(rows)
    _save(out, kind, machine, rows, lambda _: table(summary))
    plot(summary, out / f"{kind}.png", f"weight sync, {kind}: {machine}")


def _report(kind: str, out: Path) -> None:
    data = json.loads((out / f"{kind}.json").read_text())
    summary = summarize(data["rows"])
    text = f"{_header(data.get('measured'), data['machine'])}\n\n{table(summary)}\n"
    (out / f"{kind}.md").write_text(text)
    plot(summary, out / f"{kind}.png", f"weight sync, {kind}: {data['machine']}")
    print(text)


# The CPU set-up of the colocate benchmarks: 2 gloo ranks, a vLLM CPU engine in each.
_CPU_MACHINE = f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo ranks, vLLM CPU engine in each rank"


def _on_cpu_engines(worker: object, args: argparse.Namespace) -> list[dict]:
    """`worker(rank, world, model name, checkpoint dir, reps)` on 2 gloo ranks per model shape; every rank's rows."""
    from tests.support.dist import run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint

    from .shapes import CPU_SHAPES

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name])
            for rank_rows in run_distributed(worker, name, str(model_dir), args.reps, world_size=2, backend="gloo"):
                rows.extend(rank_rows)
    return rows


def _cpu(args: argparse.Namespace) -> None:
    from .cpu import cpu_worker

    _write("cpu", _on_cpu_engines(cpu_worker, args), args.results, _CPU_MACHINE)


def _safety(args: argparse.Namespace) -> None:
    from .safety import safety_worker

    rows = _on_cpu_engines(safety_worker, args)
    _write("safety", [r for r in rows if "seconds" in r], args.results, _CPU_MACHINE)
    digests = [r for r in rows if r.get("method") == "verify-digests" and r["rank"] == 0]
    for r in digests:
        seconds = sorted(r["verify_seconds"])
        print(f"{r['model']} {r['backend']}: verify (digests both sides) median {seconds[len(seconds) // 2] * 1e3:.1f} ms")


def _delta(args: argparse.Namespace) -> None:
    import os

    import torch

    from tests.support.dist import run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint

    from .delta import delta_table, delta_worker
    from .shapes import CPU_SHAPES

    rows: list[dict] = []
    gpu = args.engine == "buffers" and torch.cuda.is_available()
    world = args.world_size or (torch.cuda.device_count() if gpu else 2)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = str(build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name])) if args.engine == "cpu" else None
            backend = "nccl" if gpu else "gloo"
            for rank_rows in run_distributed(delta_worker, name, model_dir, args.reps, args.engine, args.copies,
                                             world_size=world, backend=backend):  # fmt: skip
                rows.extend(rank_rows)
    engine = "vLLM CPU engine in each rank" if args.engine == "cpu" else f"engine-layout buffers ({args.copies} copies)"
    device = torch.cuda.get_device_name(0) if gpu else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    machine = f"{device}, {world} rank(s), {engine}, torch {torch.__version__}"
    # NOTE: the engine-layout buffers on CPU ranks (a smoke test) never replace the GPU table.
    kind = "delta-cpu" if args.engine == "cpu" else ("delta-gpu" if gpu else "delta-buffers-cpu")
    _save(args.results, kind, machine, rows, delta_table)


def _adapter(args: argparse.Namespace) -> None:
    import os

    import torch

    from tests.support.dist import run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint

    from .adapter import adapter_table, adapter_worker
    from .shapes import CPU_SHAPES

    if args.engine == "buffers":
        _adapter_buffers(args)
        return
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = str(build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name]))
            for rank_rows in run_distributed(adapter_worker, name, model_dir, args.reps, world_size=2, backend="gloo"):
                rows.extend(rank_rows)
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 rank(s), vLLM CPU engine (LoRA enabled) in each rank, torch {torch.__version__}"
    _save(args.results, "adapter-cpu", machine, rows, adapter_table)


def _adapter_buffers(args: argparse.Namespace) -> None:
    """Adapter syncs beside merged ones into the GPU engine stand-in (one process per visible GPU)."""
    import os

    import torch

    from tests.support.dist import run_distributed

    from .adapter_gpu import adapter_gpu_table, adapter_gpu_worker

    gpu = torch.cuda.is_available()
    world = args.world_size or (torch.cuda.device_count() if gpu else 1)
    rows: list[dict] = []
    for name in args.models.split(","):
        for rank_rows in run_distributed(adapter_gpu_worker, name, args.reps, world_size=world,
                                         backend="nccl" if gpu else "gloo"):  # fmt: skip
            rows.extend(rank_rows)
    device = torch.cuda.get_device_name(0) if gpu else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    engine = "engine-layout buffers and LoRA slots (batched copies)"
    machine = f"{device}, {world} rank(s), {engine}, torch {torch.__version__}"
    # NOTE: a run on CPU ranks (a smoke test) never replaces the GPU table.
    _save(args.results, "adapter-gpu" if gpu else "adapter-buffers-cpu", machine, rows, adapter_gpu_table)


def _sparse(args: argparse.Namespace) -> None:
    import os

    import torch

    from tests.support.dist import run_distributed

    from .sparse import LEARNING_RATES, sparse_table, sparse_worker

    rows: list[dict] = []
    for name in args.models.split(","):
        for rank_rows in run_distributed(sparse_worker, name, args.reps, world_size=2, backend="gloo"):
            rows.extend(rank_rows)
    machine = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo ranks, torch {torch.__version__}; Adam (no weight "
        f"decay), learning rates {', '.join(f'{lr:g}' for lr in LEARNING_RATES)}, {args.reps} steps each"
    )
    _save(args.results, "sparse-cpu", machine, rows, sparse_table)


def _sparse_sync(args: argparse.Namespace) -> None:
    import os

    import torch

    from tests.support.dist import free_port, run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync._demo.vllm_server import VLLMServerProcess
    from fsdp_sync.transfer.plugin import SPARSE_ENV

    from .shapes import CPU_SHAPES
    from .sparse import LEARNING_RATES
    from .sparse_sync import sparse_sync_table, sparse_sync_worker

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name])
            for mode in args.modes.split(","):
                if mode == "server":
                    with VLLMServerProcess(
                        model_dir, Path(tmp) / f"{name}-server.log", readable_weights=False, env={SPARSE_ENV: "1"}
                    ) as server:
                        results = run_distributed(
                            sparse_sync_worker, name, str(model_dir), mode, args.steps, server.base_url, free_port(),
                            world_size=2, backend="gloo",
                        )  # fmt: skip
                else:
                    results = run_distributed(
                        sparse_sync_worker, name, str(model_dir), mode, args.steps, None, 0, world_size=2,
                        backend="gloo",
                    )  # fmt: skip
                for rank_rows in results:
                    rows.extend(rank_rows)
    machine = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo ranks (FSDP2), torch {torch.__version__}; Adam (no "
        f"weight decay), learning rates {', '.join(f'{lr:g}' for lr in LEARNING_RATES)}, {args.steps} steps each; "
        "vLLM CPU engine (bf16): one server process (gloo transfer) or one in-process engine per rank"
    )
    _save(args.results, "sparse-sync-cpu", machine, rows, sparse_sync_table)


def _server(args: argparse.Namespace) -> None:
    import os

    from tests.support.dist import free_port, run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync._demo.vllm_server import VLLMServerProcess

    from .server import server_worker
    from .shapes import CPU_SHAPES

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_checkpoint(Path(tmp) / name, CPU_SHAPES[name])
            with VLLMServerProcess(model_dir, Path(tmp) / f"{name}-server.log", readable_weights=False) as server:
                ports = [free_port(), free_port()]
                for rank_rows in run_distributed(
                    server_worker, name, str(model_dir), server.base_url, args.reps, ports, world_size=2,
                    backend="gloo",
                ):  # fmt: skip
                    rows.extend(rank_rows)
    machine = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo trainer ranks, one vLLM CPU server process "
        "(bf16), gloo weight transfer"
    )
    _write("server", rows, args.results, machine)


def _async(args: argparse.Namespace) -> None:
    import os

    import torch

    from .async_sync import async_rows, async_table

    rows = async_rows(args.models.split(","), args.steps, args.rounds)
    machine = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo trainer ranks (FSDP2), torch {torch.__version__}; "
        f"TRL's AsyncGRPOTrainer with its rollout worker generating on one vLLM CPU server (bf16), gloo weight "
        f"transfer; {args.rounds} jobs per method, alternating, {args.steps} steps each"
    )
    _save(args.results, "async-cpu", machine, rows, async_table)


def _gpu(args: argparse.Namespace) -> None:
    import torch

    from tests.support.dist import run_distributed

    from .gpu import gpu_worker

    world = args.world_size or torch.cuda.device_count()
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # gloo: smoke test of the code on CPU ranks
    rows: list[dict] = []
    for name in args.models.split(","):
        for rank_rows in run_distributed(gpu_worker, name, args.reps, args.check, world_size=world, backend=backend):
            rows.extend(rank_rows)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke test)"
    machine = f"{world}x {device}, {backend}, torch {torch.__version__}"
    # NOTE: a run on CPU ranks (a smoke test, or the host work of `qwen2-layout`) never replaces the GPU tables.
    kind = ("gpu" if world == 1 else f"gpu{world}") + ("" if torch.cuda.is_available() else "-cpu")
    _write(kind, rows, args.results, machine)
    replays = [r for r in rows if "graph_replays" in r and r["rank"] == 0]
    notes = [f"- {r['model']} {r['backend']}: ours-flat-graph replayed its CUDA graph in {r['graph_replays']} of "
             f"{args.reps + 1} syncs" for r in replays]  # fmt: skip
    skipped = [r for r in rows if "skipped" in r and r["rank"] == 0]
    notes += sorted({f"- {r['model']} {r['backend']}: {r['skipped']}" for r in skipped})
    with (args.results / f"{kind}.md").open("a") as md:
        md.write("\n" + "\n".join(notes) + "\n")
    print("\n".join(notes))


def _kernels(args: argparse.Namespace) -> None:
    import torch

    from .kernels import device_and_rate, kernels_rows, kernels_table, sweep_rows

    sources = [getattr(torch, name) for name in args.sources.split(",")]
    measured = device_and_rate()  # one floor for every row
    rows = kernels_rows(args.models.split(","), sources, args.reps, measured)
    if args.sweep:
        rows += sweep_rows(args.models.split(","), args.reps, measured)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"{platform.machine()} CPU (smoke test, Triton interpreter)"
    machine = f"{device}, torch {torch.__version__}"
    kind = "kernels" if cuda else "kernels-cpu"
    _save(args.results, kind, machine, rows, kernels_table)


def _profile(args: argparse.Namespace) -> None:
    """Device busy time against wall time for the two GPU near misses (`benchmarks.gpu_profile`)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.run profile traces CUDA kernels: it needs a GPU")
    from tests.support.dist import run_distributed

    from .gpu_profile import profile_table, profile_worker

    (rows,) = run_distributed(profile_worker, args.reps, world_size=1, backend="nccl")
    machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    _save(args.results, "profile-gpu", machine, rows, profile_table)


def _gpu_suite(args: argparse.Namespace) -> None:
    """The GPU figures (issues 29, 35 and 41) in one command: each part as its own subcommand would run it."""
    parts = [
        ["gpu", "--models", "qwen2-1.5b,qwen2-7b", "--check"],
        ["delta", "--engine", "buffers", "--models", "qwen2-1.5b,qwen2-7b"],
        ["kernels", "--models", "qwen2-7b,qwen2-1.5b"],
        ["adapter", "--engine", "buffers", "--models", "qwen2-7b"],
    ]
    for part in parts:
        print(f"== python -m benchmarks.run {' '.join(part)} --reps {args.reps}", flush=True)
        main([*part, "--reps", str(args.reps), "--results", str(args.results)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--models", default="qwen2-36m,qwen2-150m")
    server = sub.add_parser("server")
    server.add_argument("--models", default="qwen2-36m,qwen2-150m")
    safety = sub.add_parser("safety")
    safety.add_argument("--models", default="qwen2-36m,qwen2-150m")
    adapter = sub.add_parser("adapter")
    adapter.add_argument("--models", default="qwen2-36m,qwen2-150m")
    adapter.add_argument("--engine", choices=["cpu", "buffers"], default="cpu",
                         help="the vLLM CPU engine in each rank, or the GPU engine stand-in (e.g. --models qwen2-7b)")
    adapter.add_argument("--world-size", type=int, default=0)
    delta = sub.add_parser("delta")
    delta.add_argument("--models", default="qwen2-36m,qwen2-150m")
    delta.add_argument("--engine", choices=["cpu", "buffers"], default="cpu")
    delta.add_argument("--world-size", type=int, default=0)
    delta.add_argument("--copies", choices=["loop", "batched", "graph"], default="batched",
                       help="how the engine-layout buffers are filled (--engine buffers)")
    sparse_sync = sub.add_parser("sparse-sync")
    sparse_sync.add_argument("--models", default="qwen2-36m,qwen2-150m")
    sparse_sync.add_argument("--modes", default="server,colocate")
    sparse_sync.add_argument("--steps", type=int, default=5)
    sparse = sub.add_parser("sparse")
    sparse.add_argument("--models", default="qwen2-36m,qwen2-150m")
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--models", default="qwen2-1.5b,qwen2-7b")
    gpu.add_argument("--world-size", type=int, default=0)
    gpu.add_argument("--check", action="store_true", help="verify the engine buffers bit for bit after each method")
    kernels = sub.add_parser("kernels")
    kernels.add_argument("--models", default="qwen2-7b")
    kernels.add_argument("--sources", default="bfloat16,float32")
    kernels.add_argument("--sweep", action="store_true", help="also time sparse extraction at each launch shape")
    suite = sub.add_parser("gpu-suite")
    profiled = sub.add_parser("profile", help="device busy time against wall time of the GPU near misses")
    asynchronous = sub.add_parser("async")
    asynchronous.add_argument("--models", default="qwen2-36m")
    asynchronous.add_argument("--steps", type=int, default=4)
    asynchronous.add_argument("--rounds", type=int, default=2)
    asynchronous.add_argument("--results", type=Path, default=RESULTS)
    rep = sub.add_parser("report")
    rep.add_argument("--kind", default="cpu")
    sparse_sync.add_argument("--results", type=Path, default=RESULTS)
    for p in (cpu, server, safety, adapter, delta, sparse, gpu, kernels, suite, profiled, rep):
        p.add_argument("--reps", type=int, default=5)
        p.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    match args.kind:
        case "cpu":
            _cpu(args)
        case "server":
            _server(args)
        case "safety":
            _safety(args)
        case "adapter":
            _adapter(args)
        case "delta":
            _delta(args)
        case "sparse":
            _sparse(args)
        case "sparse-sync":
            _sparse_sync(args)
        case "gpu":
            _gpu(args)
        case "kernels":
            _kernels(args)
        case "gpu-suite":
            _gpu_suite(args)
        case "profile":
            _profile(args)
        case "async":
            _async(args)
        case "report":
            _report(args.kind if args.kind != "report" else "cpu", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
