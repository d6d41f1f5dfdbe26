"""Sparse syncs to a real vLLM server process (CPU build, this package's gloo backend): the patches travel as one
sparse round (blocks, low 16 bits of each index, values) and the server's workers write them in place
(`load_checkpoint_weight_patches`); after every sync every server weight equals the trainer's, bit for bit (the
server's own digests), and the report gives the changed fraction and the bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dist import free_port
from fsdp_sync._demo.vllm_server import VLLMServerProcess
from fsdp_sync.transfer.plugin import SPARSE_ENV

from .helpers import assert_synced_every_time, run_grpo
from .test_sparse import LR, STEPS, _show, _sparse_reports

pytestmark = pytest.mark.e2e


def _server_args(url: str, *extra: str) -> list[str]:
    return ["--vllm-mode", "server", "--server-url", url, "--group-port", str(free_port()), *extra]


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_sparse_syncs_to_a_server_are_bit_exact(backend: str, server: VLLMServerProcess, checkpoints, tmp_path) -> None:
    result = run_grpo(
        checkpoints("qwen2"), tmp_path, backend, "--sparse", "--lr", LR, "--steps", str(STEPS),
        *_server_args(server.base_url),
    )  # fmt: skip
    ranks = assert_synced_every_time(result, backend, steps=STEPS, generations_change=False)
    for reports in _sparse_reports(ranks[:1], smaller=True):  # rank 0 pushes (the others report no patches)
        _show(f"server sparse {backend}", reports)
    for r in ranks[1:]:
        assert all(rep["sparse"] for rep in r["reports"][1:])


def test_sparse_syncs_to_a_server_started_with_the_sparse_switch(checkpoints, tmp_path: Path) -> None:
    """A server as users start it (vLLM-CPU packs its linear weights away) but with FSDP_VLLM_SYNC_SPARSE=1: the
    plugin keeps them, every tensor can be patched, and the server is bit-exact after every sync."""
    model_dir = checkpoints("qwen2")
    with VLLMServerProcess(
        model_dir, tmp_path / "server.log", readable_weights=False, env={SPARSE_ENV: "1"}
    ) as switched:
        result = run_grpo(
            model_dir, tmp_path / "job", "fsdp2", "--sparse", "--lr", LR, "--steps", str(STEPS),
            *_server_args(switched.base_url),
        )  # fmt: skip
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS, generations_change=False)
    for reports in _sparse_reports(ranks[:1], smaller=True):
        _show("server sparse (switch)", reports)
    assert "sparse syncs send" not in result.log, "no tensor may be refused by the server"
