"""Model families and features end to end: real trainer, real vLLM CPU engine, FSDP1 and FSDP2 on 2 gloo ranks.

Each run checks, after every sync, every engine weight against the trainer's full weight bit for bit (directly for
dense weights, and through the engine's loader for all, including fused experts).
"""

from __future__ import annotations

import pytest

from .helpers import assert_synced_every_time, checkpoint_tensor_count, run_grpo

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_family(family: str, backend: str, checkpoints, tmp_path) -> None:
    model_dir = checkpoints(family)
    result = run_grpo(model_dir, tmp_path, backend)
    # Mixture of experts: vLLM fuses experts (w13/w2) in a layout not re-derived here; checked through the loader.
    assert_synced_every_time(
        result, backend, tensors=checkpoint_tensor_count(model_dir), dense=family != "qwen3_moe"
    )
    if family == "qwen3_moe":
        names = result.ranks[0]["trainer_names"]
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), "transformers 5 keeps experts fused"


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_attention_variant_and_moe_families_under_fsdp2(family: str, checkpoints, tmp_path) -> None:
    """gpt-oss (attention sinks; expert stacks with biases, which vLLM's own loader writes around an in-place reload)
    and DeepSeek-V3 (latent attention on a bf16 engine, routed and shared experts, a router bias transformers keeps
    as a buffer and vLLM as a float32 weight) through the real trainer: FSDP2 shards the 1-D sinks, the 3-D expert
    stacks and the buffer's owner like any other unit; every sync bit-exact (experts through the engine's loader)."""
    model_dir = checkpoints(family)
    result = run_grpo(model_dir, tmp_path, "fsdp2")
    ranks = assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir), dense=False)
    names = ranks[0]["trainer_names"]
    if family == "gpt_oss":
        assert any(n.endswith("self_attn.sinks") for n in names) and any(n.endswith("experts.gate_up_proj") for n in names)
    else:
        assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in names), "the buffer is sent like a weight"


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_lora_merged_push(backend: str, checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen2")
    # Every sync complete (delta off): every tensor, every time; delta syncs with LoRA are in test_delta.py.
    ranks = assert_synced_every_time(
        run_grpo(model_dir, tmp_path, backend, "--peft", "--no-delta"), backend, tensors=checkpoint_tensor_count(model_dir)
    )
    for r in ranks:
        assert any("lora_A" in n for n in r["dropped"]), "adapter weights are dropped on purpose (merged)"
        assert r["checks"][-1]["lora_delta"] > 0, "the adapters must move the pushed weights, or the check is vacuous"


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_activation_checkpointing_wrappers(backend: str, checkpoints, tmp_path) -> None:
    """accelerate's `fsdp_activation_checkpointing`: FSDP1 wraps layers inside each unit after sharding (the
    flat-parameter names keep no wrapper segment); FSDP2 wraps before sharding (names carry
    `_checkpoint_wrapped_module`)."""
    model_dir = checkpoints("llama")
    result = run_grpo(model_dir, tmp_path, backend, activation_checkpointing=True)
    ranks = assert_synced_every_time(result, backend, tensors=checkpoint_tensor_count(model_dir))
    assert ranks[0]["checkpoint_wrappers"] > 0, "activation checkpointing was not applied"
    if backend == "fsdp2":
        assert any("_checkpoint_wrapped_module" in n for n in ranks[0]["trainer_names"])


def test_fsdp2_torch_compile_and_gradient_checkpointing(checkpoints, tmp_path) -> None:
    model_dir = checkpoints("qwen3")
    result = run_grpo(model_dir, tmp_path, "fsdp2", "--torch-compile", "aot_eager", "--gradient-checkpointing")
    ranks = assert_synced_every_time(result, "fsdp2", tensors=checkpoint_tensor_count(model_dir))
    assert all(n.startswith("_orig_mod.") for n in ranks[0]["trainer_names"])


def test_a_colocated_engine_on_vllms_transformers_backend_is_refused_before_training(checkpoints, tmp_path) -> None:
    """vLLM serves GPT-NeoX (vLLM 0.32) through its generic Transformers backend, which changes transformers' model
    classes in the trainer's process; the trainer's first forward would die in them. The mixin refuses when the
    trainer is built, and points to server mode (where the sweep proves such a family)."""
    result = run_grpo(checkpoints("gpt_neox"), tmp_path, "single", ranks=1, check=False)
    (rank,) = result.ranks
    error = rank["error"]
    assert error is not None and error["stage"] == "construct", error
    assert error["type"] == "UnsupportedSetupError", error
    assert "generic Transformers backend" in error["message"] and "Use server mode" in error["message"]
