"""The GPU benchmarks' parts run end to end on a CPU rank (tiny shapes), so that a change to the sync's interfaces
cannot break them unseen until a GPU is lent: issue 28 renamed a writer attribute, and the `delta` part then
stopped at once on the first GPU run (its engine stand-in lacked `engine_per_rank`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "part, kind",
    [
        (["gpu", "--models", "qwen2-smoke", "--world-size", "1", "--check"], "gpu-cpu"),
        (["delta", "--engine", "buffers", "--models", "qwen2-smoke", "--world-size", "1"], "delta-buffers-cpu"),
    ],
    ids=["gpu", "delta-buffers"],
)
def test_a_gpu_benchmark_part_runs_on_a_cpu_rank(part: list[str], kind: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *part, "--reps", "1", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = json.loads((tmp_path / f"{kind}.json").read_text())["rows"]
    assert {row["backend"] for row in rows} == {"fsdp1", "fsdp2"}, rows[:3]
    assert any(row["method"].endswith("ours-flat") or row["method"].endswith("ours-delta") for row in rows)
