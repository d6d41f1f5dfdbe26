"""`fsdp-vllm-sync-check`: the mapping it prints, and a non-zero exit naming every name the engine would reject."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_sync.dry_run import main
from fsdp_sync.testing.models import build_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2", "plain"])
@pytest.mark.parametrize("lora", [None, "q_proj,v_proj"])
def test_dry_run_accepts_matching_checkpoint(qwen2: Path, backend: str, lora: str | None, capsys) -> None:
    argv = [str(qwen2), "--backend", backend] + (["--lora", lora] if lora else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "OK: every engine weight is sent exactly once" in out
    assert "-> model.layers.0.self_attn.q_proj.weight" in out or "= model.layers.0.self_attn.q_proj.weight" in out
    assert "26 tensors sent" in out  # the tied lm_head is sent once, as the embedding
    if lora:
        assert "lora_A" in out and "merged into its base weight" in out


def test_dry_run_moe_reverts_fused_experts(tmp_path: Path, capsys) -> None:
    model_dir = build_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    assert main([str(model_dir), "--backend", "fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.experts.gate_up_proj -> model.layers.0.mlp.experts.3.up_proj.weight" in out


def test_dry_run_rejects_and_names_offenders(qwen2: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in qwen2.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(qwen2 / "model.safetensors"))
    del state["model.norm.weight"]  # the trainer sends it but the engine lacks it: unknown
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 64)  # shape mismatch
    state["model.extra.weight"] = torch.zeros(4)  # the trainer never sends it: stale
    save_file(state, str(broken / "model.safetensors"))
    assert main([str(broken), "--backend", "fsdp2"]) == 1
    out = capsys.readouterr().out
    assert "REJECTED" in out
    assert "model.norm.weight  (from model.norm.weight)" in out
    assert "model.extra.weight" in out
    assert "model.layers.0.mlp.down_proj.weight: trainer (128, 256) vs engine (128, 64)" in out
