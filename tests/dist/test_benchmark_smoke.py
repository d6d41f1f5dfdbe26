"""The GPU benchmarks' parts run end to end on a CPU rank (tiny shapes), so that a change to the sync's interfaces
cannot break them unseen until a GPU is lent: issue 28 renamed a writer attribute, and the `delta` part then
stopped at once on the first GPU run (its engine stand-in lacked `engine_per_rank`).

The parts run with the GPUs hidden (`CUDA_VISIBLE_DEVICES=""`), so that on a machine with CUDA they run on a CPU
rank too and write their CPU-rank results (`gpu-cpu.json`, not the GPU tables' `gpu.json`)."""

from __future__ import annotations

import json
import os
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
        (["adapter", "--engine", "buffers", "--models", "qwen2-smoke", "--world-size", "1"], "adapter-buffers-cpu"),
    ],
    ids=["gpu", "delta-buffers", "adapter-buffers"],
)
def test_a_gpu_benchmark_part_runs_on_a_cpu_rank(part: list[str], kind: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *part, "--reps", "1", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = json.loads((tmp_path / f"{kind}.json").read_text())["rows"]
    assert {row["backend"] for row in rows} == {"fsdp1", "fsdp2"}, rows[:3]
    methods = ("ours-flat", "ours-delta", "adapter")
    assert any(row["method"].endswith(methods) for row in rows), rows[:3]
    # Every method of the adapter part is compared with the trainer's weights bit for bit: none may differ.
    exact = [row["exact"] for row in rows if "exact" in row]
    assert all(not names for per_method in exact for names in per_method.values()), exact
    assert kind != "adapter-buffers-cpu" or len(exact) == 4, exact


def test_the_adapter_parts_check_names_a_lora_slot_that_differs() -> None:
    """The LoRA slots of the GPU engine stand-in hold lora_A and scaling x lora_B as loaded, bit for bit, and its
    check names a module whose slot differs in one element (so the `exact` column cannot pass without the sync)."""
    import torch

    from benchmarks.adapter_gpu import LoRABuffersWriter
    from fsdp_sync.compat.lora_api import Adapter
    from fsdp_sync.compat.manifest import TensorSpec

    specs = {f"model.layers.0.self_attn.{m}.weight": TensorSpec((o, 32), torch.bfloat16)
             for m, o in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16), ("o_proj", 32))}  # fmt: skip
    writer = LoRABuffersWriter(specs, dtype=torch.bfloat16, device=torch.device("cpu"), checkpoint="unused")
    generator = torch.Generator().manual_seed(0)
    full = {}
    for module, out in (("model.layers.0.self_attn.q_proj", 32), ("model.layers.0.self_attn.v_proj", 16)):
        full[f"{module}.lora_A"] = torch.randn(8, 32, generator=generator).to(torch.bfloat16)
        full[f"{module}.lora_B"] = torch.randn(out, 8, generator=generator).to(torch.bfloat16)
    tensors = {f"base_model.model.{key}.weight": value for key, value in full.items()}
    writer.load_adapter(Adapter(1, "a-v1", tensors, {"r": 8, "lora_alpha": 16}))
    assert writer.adapter_mismatches(full, scaling=2.0) == []
    assert not writer.lora_a["model.layers.0.self_attn.k_proj"].any()  # not targeted: zero, as vLLM serves it
    writer.lora_b["model.layers.0.self_attn.v_proj"][3, 5] += 1
    writer.lora_a["model.layers.0.self_attn.o_proj"][0, 0] = 1
    assert writer.adapter_mismatches(full, scaling=2.0) == ["model.layers.0.self_attn.o_proj",
                                                            "model.layers.0.self_attn.v_proj"]  # fmt: skip


def test_the_profile_part_needs_a_gpu_and_counts_overlapping_device_intervals_once(tmp_path: Path) -> None:
    """`benchmarks.run profile` traces CUDA kernels: without a GPU it stops with that reason and writes nothing; its
    device busy time is the union of the kernels' intervals (overlaps counted once, gaps not at all)."""
    from types import SimpleNamespace

    from benchmarks.gpu_profile import _busy_ms, profile_table

    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "profile", "--reps", "1", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode != 0 and "needs a GPU" in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.iterdir())

    def event(start_us: float, end_us: float) -> SimpleNamespace:
        return SimpleNamespace(time_range=SimpleNamespace(start=start_us, end=end_us))

    assert _busy_ms([event(2000, 2500), event(0, 1000), event(500, 1500), event(600, 700)]) == 2.0
    row = {"what": "w", "tensors": 3, "wall_ms": 4.0, "busy_ms": 2.0, "floor_ms": 1.0, "kernels": [["k", 1.5], ["j", 0.5]]}
    assert profile_table([row]).splitlines()[-1] == "| w | 3 | 4.00 | 2.00 | 0.50 | 1.00 | 4.00 | 2.00 | `k` | 1.50 | 1.50 | `j` 0.50 |"
