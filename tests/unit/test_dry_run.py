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


@pytest.mark.parametrize(
    ("backend", "lora_r", "max_lora_rank", "code", "says"),
    [
        ("fsdp2", "8", "8", 0, "OK: an adapter sync would send this adapter"),
        ("fsdp1", "16", "8", 1, "REFUSED (adapter sync): rank 16 is above max_lora_rank 8: start the engine with "
                                "max_lora_rank=16 (a server: --max-lora-rank 16)"),
    ],
    ids=["accepted", "rank-above"],
)  # fmt: skip
def test_adapter_check_says_what_an_adapter_sync_would_refuse_and_the_fix(
    qwen2: Path, backend: str, lora_r: str, max_lora_rank: str, code: int, says: str, capsys
) -> None:
    """Issue 49: `--adapter` checks an adapter plan before training (exit 0 where it would be accepted), naming the
    setting that fixes a refusal and the merged fallback; the merged mapping is checked as before."""
    argv = [str(qwen2), "--backend", backend, "--lora", "q_proj,v_proj", "--lora-r", lora_r, "--adapter",
            "--max-lora-rank", max_lora_rank]  # fmt: skip
    assert main(argv) == code
    out = capsys.readouterr().out
    assert says in out
    assert "OK: every engine weight is sent exactly once" in out
    assert "8 adapter tensors sent" in out
    assert "-> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in out
    assert f"LoRA settings the engine needs (adapter rank {lora_r}): start the engine with enable_lora=True" in out
    if code:
        assert "use merged syncs instead: SyncConfig(adapter=False)" in out


def test_adapter_check_names_a_trainable_base_parameter_and_a_model_without_peft(qwen2: Path, capsys) -> None:
    """The plan's own refusals (no engine needed), each with its fix."""
    from fsdp_sync.cli import meta_model
    from fsdp_sync.dry_run import _add_lora, adapter_check

    model = _add_lora(meta_model(qwen2, torch.float32), ["q_proj"], 8)
    model.base_model.model.model.norm.weight.requires_grad_(True)
    assert not adapter_check(model, max_lora_rank=8)
    out = capsys.readouterr().out
    assert "trainable parameters outside the adapter (the engine's base would go stale)" in out
    assert "model.norm.weight (freeze them: requires_grad=False)" in out
    assert not adapter_check(meta_model(qwen2, torch.float32), max_lora_rank=None)
    assert "REFUSED (adapter sync): the model has no PEFT adapter" in capsys.readouterr().out


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


def test_a_max_lora_rank_vllm_does_not_accept_is_one_line(qwen2: Path, capsys) -> None:
    err = _usage_error(capsys, [str(qwen2), "--lora", "q_proj", "--adapter", "--max-lora-rank", "12"])
    assert "--max-lora-rank 12: vLLM does not accept it (the next value up is 16)" in err


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
        (["--lora", "q_proj", "--adapter", "--max-lora-rank", "0"], "argument --max-lora-rank: '0' is not a positive"),
    ],
)
def test_malformed_arguments_exit_2(qwen2: Path, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(qwen2), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

