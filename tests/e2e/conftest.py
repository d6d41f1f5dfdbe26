"""Engines shared by the end-to-end modules."""

from __future__ import annotations

import pytest

from fsdp_sync._demo.vllm_server import VLLMServerProcess


@pytest.fixture(scope="session")
def server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """One real server for the session (tiny Qwen2, bf16 engine, gloo weight transfer, readable weights).

    NOTE: shared by the server-mode and fault modules: starting one takes 25-60 s on the 2-core CI machine. Every
    job that uses it starts with a complete sync and checks against the server's own digests read before each sync,
    so no test depends on what an earlier one left there; faults that need a server of their own (no weight-transfer
    backend, killed mid-sync) and other models start one each.
    """
    with VLLMServerProcess(checkpoints("qwen2"), tmp_path_factory.mktemp("server") / "server.log") as process:
        yield process


@pytest.fixture(scope="session")
def lora_server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """One real server with LoRA enabled for the adapter tests (tiny Qwen2, float32 engine, gloo weight transfer),
    keeping the last 2 adapter versions servable (`FSDP_VLLM_SYNC_ADAPTER_VERSIONS=2`, within `--max-cpu-loras 2`).
    No `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: pushed versions are served without vLLM's resolvers. Each adapter job
    pushes new adapter names, so no job depends on what another left."""
    with VLLMServerProcess(
        checkpoints("qwen2"),
        tmp_path_factory.mktemp("lora_server") / "server.log",
        dtype="float32",
        env={"FSDP_VLLM_SYNC_ADAPTER_VERSIONS": "2"},
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "2"],
    ) as process:
        yield process


# NOTE: vLLM-CPU refuses to start two workers without one CPU list per worker ("Not enough allowed NUMA nodes to
# bind threads of 2 local CPUWorkers"); "0|1" pins one worker per core on the 2-core CI machine.
MULTI_WORKER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="session")
def tp2_server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """One real tensor-parallel server (`--tensor-parallel-size 2`: every column/row-parallel weight is split over
    two workers), tiny Qwen2, bf16, gloo weight transfer, readable weights. Every job starts with a complete sync."""
    with VLLMServerProcess(
        checkpoints("qwen2"),
        tmp_path_factory.mktemp("tp2_server") / "server.log",
        env=MULTI_WORKER_ENV,
        extra_args=["--tensor-parallel-size", "2"],
    ) as process:
        yield process


@pytest.fixture(scope="session")
def dp2_server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """One real data-parallel server (`--data-parallel-size 2`: two whole replicas), as `tp2_server` otherwise."""
    with VLLMServerProcess(
        checkpoints("qwen2"),
        tmp_path_factory.mktemp("dp2_server") / "server.log",
        env=MULTI_WORKER_ENV,
        extra_args=["--data-parallel-size", "2"],
    ) as process:
        yield process
