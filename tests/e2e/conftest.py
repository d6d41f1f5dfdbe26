"""Engines shared by the end-to-end modules."""

from __future__ import annotations

import os

import pytest

from tests.support.launch import launch_env
from tests.support.prefork import PREFORK_ENV, PreforkServer
from fsdp_sync._demo.vllm_server import VLLMServerProcess

from .documented import DocumentedServer


@pytest.fixture(scope="session", autouse=True)
def prefork_server(tmp_path_factory: pytest.TempPathFactory):
    """One fork server for the session's jobs: their ranks are forked from a process that has imported the stack
    once, instead of each paying the imports (about half of a small job's CPU time; tests/support/prefork.py).
    `FSDP_VLLM_SYNC_TEST_PREFORK=0` turns it off (every job then goes through `accelerate launch`)."""
    if os.environ.get(PREFORK_ENV) == "0":
        yield None
        return
    server = PreforkServer(tmp_path_factory.mktemp("prefork"), launch_env())
    os.environ[PREFORK_ENV] = server.socket_path
    try:
        yield server
    finally:
        os.environ.pop(PREFORK_ENV, None)
        server.close()


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
    """docs/adapters.md's LoRA server command, as written there (tiny Qwen2, float32 engine, gloo weight transfer,
    the last 2 adapter versions kept: `FSDP_VLLM_SYNC_ADAPTER_VERSIONS=2` within `--max-cpu-loras 2`; no
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), with readable weights. Each adapter job pushes new adapter names, so no job
    depends on what another left."""
    server = DocumentedServer(
        checkpoints("qwen2"), tmp_path_factory.mktemp("lora_server") / "server.log", "adapters.md", "--enable-lora",
        readable_weights=True,
    )  # fmt: skip
    with server as process:
        yield process
        process.raise_on_worker_death()


@pytest.fixture(scope="module")
def tp2_server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """docs/server.md's tensor-parallel CPU command, as written there (`--tensor-parallel-size 2`: every column/row-
    parallel weight split over two workers; `VLLM_CPU_OMP_THREADS_BIND="0|1"`: one worker per core), with readable
    weights. Every job starts with a complete sync. NOTE: module-scoped: its workers hold both cores' bindings and
    their memory, so it stops with the one module that uses it."""
    server = DocumentedServer(
        checkpoints("qwen2"), tmp_path_factory.mktemp("tp2_server") / "server.log", "server.md",
        "--tensor-parallel-size 2", readable_weights=True,
    )  # fmt: skip
    with server as process:
        yield process
        process.raise_on_worker_death()


@pytest.fixture(scope="module")
def dp2_server(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """docs/server.md's data-parallel CPU command (`--data-parallel-size 2`: two whole replicas), as `tp2_server`."""
    server = DocumentedServer(
        checkpoints("qwen2"), tmp_path_factory.mktemp("dp2_server") / "server.log", "server.md",
        "--data-parallel-size 2", readable_weights=True,
    )  # fmt: skip
    with server as process:
        yield process
        process.raise_on_worker_death()
