"""The backend matrix on the real stack: TRL trainer + FSDPVLLMSyncMixin + in-process vLLM CPU engine, 2 gloo ranks.

After every sync, every engine weight equals the trainer's full weight bit for bit (see
`tests.support.grpo_job`); the FSDP wrapper type is asserted (accelerate on CPU falls back to DDP unless FSDP
is made real), and greedy generations change after training with a large learning rate. The matrix's jobs keep the
engine compiled, as users run it (the other jobs of the suite run it eagerly: the job's `--eager-engine`).
"""

from __future__ import annotations

import pytest

from .helpers import assert_synced_every_time, checkpoint_tensor_count, run_grpo

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2", "ddp"])
def test_grpo_backend_matrix(backend: str, checkpoints, tmp_path) -> None:
    """Launched the way users launch (`accelerate launch`), not forked from the session's fork server."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, backend, share_imports=False, compiled_engine=True)
    assert "[prefork]" not in result.log
    assert all(r["engine_eager"] is False for r in result.ranks)
    ranks = assert_synced_every_time(result, backend, tensors=checkpoint_tensor_count(model_dir))
    default = {"fsdp1": "fsdp1-flat", "fsdp2": "fsdp2-flat", "ddp": "plain"}[backend]
    assert all(rep["strategy"] == default for r in ranks for rep in r["reports"])


def test_grpo_single_process(checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "single", ranks=1, compiled_engine=True)
    assert all(r["engine_eager"] is False for r in result.ranks)
    assert_synced_every_time(result, "single", ranks=1, tensors=checkpoint_tensor_count(model_dir))


def test_fsdp1_flat_params_use_orig_params_false(checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp1", use_orig_params=False)
    assert all(r["engine_eager"] is True for r in result.ranks)
    assert_synced_every_time(result, "fsdp1", tensors=checkpoint_tensor_count(model_dir))


@pytest.mark.parametrize(
    "backend,strategy",
    [("fsdp1", "unit"), ("fsdp1", "root"), ("fsdp2", "unit"), ("fsdp2", "param")],
    ids=["fsdp1-unit", "fsdp1-root", "fsdp2-unit", "fsdp2-param"],
)
def test_alternative_strategies(backend: str, strategy: str, checkpoints, tmp_path) -> None:
    """The non-default strategies, end to end (the matrix above runs the default, "flat")."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, backend, f"--{backend}-strategy", strategy)
    ranks = assert_synced_every_time(result, backend, tensors=checkpoint_tensor_count(model_dir))
    assert all(rep["strategy"] == f"{backend}-{strategy}" for r in ranks for rep in r["reports"])


def test_rloo_trainer_fsdp2(checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp2", "--trainer", "rloo")
    assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir))


def test_online_dpo_trainer_fsdp1(checkpoints, tmp_path) -> None:
    """The experimental OnlineDPOTrainer syncs through `_move_model_to_vllm`, which the mixin overrides."""
    model_dir = checkpoints("qwen2")
    result = run_grpo(model_dir, tmp_path, "fsdp1", "--trainer", "online_dpo")
    assert_synced_every_time(result, "fsdp1", tensors=checkpoint_tensor_count(model_dir))
