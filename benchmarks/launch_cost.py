"""What starting a test's processes costs, the way CI starts them and the way it did before (docs/testing.md).

    python -m benchmarks.launch_cost [--reps 3]

Side by side in one run, alternating:
- an end-to-end GRPO job (the tiny Qwen2 of the e2e suite, FSDP2, 2 CPU ranks, the bit-exact engine check on, 2 steps)
  started by `accelerate launch` (fresh interpreters) and forked from the fork server (`tests/support/prefork.py`),
  its colocated engine compiled, and forked with the engine eager (`JOB_METHODS`): CPU seconds of every process of
  the job, and wall seconds;
- a distributed test's ranks (`run_distributed`, 2 ranks, a function that imports the test module they unpickle
  from) started with `spawn` and from the preloaded `forkserver`: each rank's own CPU seconds at the end.
Writes benchmarks/results/launch-cost-cpu.{json,md}; medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
FORKED_CPU = re.compile(r"\[prefork\] ranks exited with \[[^\]]*\] \(([\d.]+) CPU seconds\)")


# How a test's GRPO job starts: with `accelerate launch` and the engine compiled (every job, before the fork server),
# forked with the engine compiled (the backend matrix's engine, as users run it), and forked with the engine eager
# (the jobs whose subject is not the compiled engine: the job's `--eager-engine`).
JOB_METHODS: dict[str, dict[str, bool]] = {
    "launched": {"share_imports": False, "compiled_engine": True},
    "forked": {"share_imports": True, "compiled_engine": True},
    "forked, eager engine": {"share_imports": True, "compiled_engine": False},
}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def job_rows(reps: int) -> list[dict[str, Any]]:
    """`reps` GRPO jobs each way, alternating."""
    from tests.support.launch import launch_env
    from fsdp_sync._demo.models import build_tiny_checkpoint
    from tests.support.prefork import PREFORK_ENV, PreforkServer
    from tests.e2e.helpers import run_grpo

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_checkpoint(root / "qwen2", "qwen2")
        (root / "prefork").mkdir()
        started = time.monotonic()
        server = PreforkServer(root / "prefork", launch_env())
        rows.append({"what": "fork server start (once per session)", "method": "forked",
                     "wall_s": time.monotonic() - started})  # fmt: skip
        os.environ[PREFORK_ENV] = server.socket_path
        try:
            for rep in range(reps):
                for method, options in JOB_METHODS.items():
                    out = root / f"{method.replace(' ', '-').replace(',', '')}-{rep}"
                    before, start = _children_cpu(), time.monotonic()
                    result = run_grpo(model_dir, out, "fsdp2", **options)
                    wall = time.monotonic() - start
                    assert result.returncode == 0 and all(r["error"] is None for r in result.ranks), result.log[-3000:]
                    assert all(c["direct_problems"] == [] for r in result.ranks for c in r["checks"])
                    if options["share_imports"]:
                        cpu = float(FORKED_CPU.search(result.log).group(1))
                    else:
                        cpu = _children_cpu() - before
                    rows.append({"what": "GRPO job, FSDP2, 2 ranks", "method": method, "rep": rep, "cpu_s": cpu,
                                 "wall_s": wall})  # fmt: skip
        finally:
            os.environ.pop(PREFORK_ENV, None)
            server.close()
    return rows


def rank_rows(reps: int) -> list[dict[str, Any]]:
    """`reps` two-rank `run_distributed` calls each way, alternating; each rank's CPU seconds at its end."""
    import tests.support.dist as dist

    rows = []
    for rep in range(reps):
        for method in ("spawn", "forkserver"):
            start = time.monotonic()
            cpus = dist.run_distributed(rank_cpu, start_method=method)
            rows.append({"what": "distributed test ranks (2)", "method": method, "rep": rep,
                         "cpu_s": statistics.median(cpus), "wall_s": time.monotonic() - start})  # fmt: skip
    return rows


def rank_cpu(rank: int, world_size: int) -> float:
    """A distributed test's rank: import the test module it unpickles its function from, report this process's CPU
    seconds so far."""
    import tests.dist.test_full_weights  # noqa: F401 - what a rank of that test imports

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| what | method | n | CPU s (median) | wall s (median) | CPU before/after |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["what"], row["method"]), []).append(row)
    medians = {key: statistics.median(r["cpu_s"] for r in rs) for key, rs in groups.items() if "cpu_s" in rs[0]}
    for (what, method), rs in groups.items():
        cpu = medians.get((what, method))
        wall = statistics.median(r["wall_s"] for r in rs)
        ratio = ""
        if method.startswith("fork") and cpu:
            before = medians[(what, "spawn" if method == "forkserver" else "launched")]
            ratio = f"{before / cpu:.2f}x"
        lines.append(f"| {what} | {method} | {len(rs)} | {'' if cpu is None else f'{cpu:.1f}'} | {wall:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                        ("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1")):  # fmt: skip
        os.environ.setdefault(name, value)  # as tests/conftest.py sets them
    rows = rank_rows(args.reps) + job_rows(args.reps)
    import torch

    head = (f"Measured {date.today().isoformat()}. Machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch "
            f"{torch.__version__}; {args.reps} runs per method, alternating; CPU seconds of every process the "
            "method starts (a forked job's, as its fork server counts its ranks)")  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "launch-cost-cpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.results / "launch-cost-cpu.md").write_text(head + "\n\n" + table(rows) + "\n")
    print(head + "\n\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
