"""The FSDP1 -> FSDP2 migration check (`fsdp-vllm-sync-check MODEL --accelerate-config fsdp1.yaml --compare-fsdp2`):
accelerate's own converter, the plans under both configs, and what differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from fsdp_sync.dry_run import main
from fsdp_sync.migration import compare_plans, wrap_spec
from fsdp_sync._demo.models import build_tiny_checkpoint

# The configuration of the original FSDP bug report (accelerate FSDP1, as TRL's examples ship it).
SEED_FSDP1 = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": False,
        "fsdp_offload_params": False,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_sync_module_states": True,
        "fsdp_use_orig_params": False,
    },
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _write(tmp_path: Path, config: dict, name: str = "fsdp1.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def _check(qwen2: Path, config: Path) -> int:
    return main([str(qwen2), "--accelerate-config", str(config), "--compare-fsdp2", "--dtype", "float32"])


def test_seed_config_gives_the_same_plan(qwen2: Path, tmp_path: Path, capsys) -> None:
    config = _write(tmp_path, SEED_FSDP1)
    assert _check(qwen2, config) == 0
    out = capsys.readouterr().out
    assert "SAME PLAN" in out and "FSDP1 (fsdp1-flat): 26 tensors; FSDP2 (fsdp2-flat): 26 tensors" in out
    assert "fsdp_use_orig_params: removed" in out
    converted = yaml.safe_load((tmp_path / "fsdp1-fsdp2.yaml").read_text())
    fsdp = converted["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
    assert "fsdp_use_orig_params" not in fsdp and "fsdp_backward_prefetch" not in fsdp
    assert wrap_spec(converted).param_dtype == torch.bfloat16


def test_tied_embedding_wrapped_on_its_own_is_reported(qwen2: Path, tmp_path: Path, capsys) -> None:
    """The tiny Qwen2 ties lm_head to the input embedding. With the embedding wrapped as its own unit, FSDP1 keeps the
    tie; FSDP2 shards the root's lm_head separately, so the engine would receive an lm_head the FSDP1 run never sent."""
    config = {**SEED_FSDP1, "fsdp_config": {**SEED_FSDP1["fsdp_config"], "fsdp_use_orig_params": True,
                                              "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer,Embedding"}}  # fmt: skip
    assert _check(qwen2, _write(tmp_path, config)) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT: 1 difference(s)" in out
    assert "lm_head.weight: sent under FSDP2 only" in out and "keep tied modules in one unit" in out


def test_plain_mistakes_exit_2(qwen2: Path, tmp_path: Path, capsys) -> None:
    fsdp2 = {**SEED_FSDP1, "fsdp_config": {**SEED_FSDP1["fsdp_config"], "fsdp_version": 2}}
    assert _check(qwen2, _write(tmp_path, fsdp2)) == 2
    assert "already configures FSDP2" in capsys.readouterr().err
    assert main([str(qwen2), "--compare-fsdp2"]) == 2
    assert "needs --accelerate-config" in capsys.readouterr().err
    unknown = {**SEED_FSDP1, "fsdp_config": {**SEED_FSDP1["fsdp_config"], "fsdp_transformer_layer_cls_to_wrap": "Nope"}}
    assert _check(qwen2, _write(tmp_path, unknown)) == 1
    assert "cannot be wrapped as configured" in capsys.readouterr().out


def test_compare_plans_names_every_difference() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    first = {"a": ((2, 2), f32, bf16), "b": ((3,), f32, bf16), "only1": ((1,), f32, bf16)}
    second = {"a": ((2, 2), f32, f32), "b": ((4,), f32, bf16), "only2": ((1,), f32, bf16)}
    assert compare_plans(first, second, ("FSDP1", "FSDP2")) == [
        "only1: sent under FSDP1 only",
        "only2: sent under FSDP2 only",
        "a: dtype on the wire during the gather torch.bfloat16 under FSDP1, torch.float32 under FSDP2",
        "b: shape (3,) under FSDP1, (4,) under FSDP2",
    ]
