"""`fsdp-vllm-sync-check`: the mapping it prints, exit 1 naming every name the engine would reject, and exit 2 with
one line for a plain mistake."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_sync.dry_run import main
from fsdp_sync._demo.models import build_tiny_checkpoint


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


# Plain mistakes: one line on stderr naming the fix, exit code 2, no traceback, nothing on stdout.


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def test_missing_model_directory_is_one_line(tmp_path: Path, capsys) -> None:
    err = _usage_error(capsys, [str(tmp_path / "no-such-model")])
    assert f"model directory '{tmp_path / 'no-such-model'}' does not exist" in err
    assert "Repo id" not in err  # transformers' message for a hub id


def test_config_without_weights_is_one_line(qwen2: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_bytes((qwen2 / "config.json").read_bytes())
    err = _usage_error(capsys, [str(tmp_path), "--backend", "plain"])
    assert f"No *.safetensors or *.bin weights in {tmp_path}" in err


def test_directory_without_config_is_one_line(tmp_path: Path, capsys) -> None:
    err = _usage_error(capsys, [str(tmp_path), "--backend", "plain"])
    assert f"{tmp_path} has no config.json" in err


def test_unknown_lora_target_is_one_line(qwen2: Path, capsys) -> None:
    # PEFT alone would accept this list (q_proj matches) and silently leave out the misspelt target.
    err = _usage_error(capsys, [str(qwen2), "--backend", "plain", "--lora", "q_proj,vproj"])
    assert "--lora vproj: no module of that name in Qwen2ForCausalLM" in err
    assert "q_proj, up_proj, v_proj" in err  # the names it could have meant


def test_lora_target_that_matches_nothing_is_one_line(qwen2: Path, capsys) -> None:
    """The case PEFT itself rejects with NoMatchingPeftModuleError and a traceback."""
    err = _usage_error(capsys, [str(qwen2), "--backend", "fsdp2", "--lora", "attention"])
    assert "--lora attention: no module of that name" in err


def test_lora_target_that_is_a_block_is_one_line(qwen2: Path, capsys) -> None:
    err = _usage_error(capsys, [str(qwen2), "--backend", "plain", "--lora", "mlp"])
    assert "--lora mlp: PEFT cannot adapt Qwen2MLP; name layers, e.g. down_proj" in err


def test_missing_extra_is_named(qwen2: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what find_spec reports for a module not installed
    err = _usage_error(capsys, [str(qwen2), "--backend", "plain"])
    assert "transformers not installed; install with: pip install 'fsdp-vllm-sync[trl]'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "bf16"], "--dtype: invalid choice: 'bf16' (choose from 'bfloat16', 'float16', 'float32')"),
        (["--backend", "fsdp3"], "argument --backend: invalid choice: 'fsdp3'"),
        (["--lora-r", "0"], "argument --lora-r: '0' is not a positive whole number"),
        (["--lora", "q_proj,"], "argument --lora: empty module name in 'q_proj,'"),
    ],
)
def test_malformed_arguments_exit_2(qwen2: Path, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(qwen2), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

