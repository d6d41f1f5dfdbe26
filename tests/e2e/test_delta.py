"""Delta syncs on the real stack (TRL GRPOTrainer + mixin, in-process vLLM CPU engine on each of 2 gloo ranks):
after the first complete sync, only what can have changed is sent, every sync bit-exact.

LoRA on q_proj/v_proj changes only parts of vLLM's fused `qkv_proj` (the whole fused module is sent); LoRA on all
linear layers changes every linear weight (norms and the embedding are skipped); a frozen embedding is skipped.
A skipped weight changed in place between two syncs must be found, sent and logged; `requires_grad` flipped between
two syncs must make the next sync complete. After every sync the engine is checked against the trainer's full
weights, bit for bit (`tests.support.grpo_job`, the demo job with the tests' additions).
"""

from __future__ import annotations

import pytest

from .helpers import assert_synced_every_time, run_grpo

pytestmark = pytest.mark.e2e

STEPS = 3


def _reports(ranks: list[dict]) -> list[list[dict]]:
    out = []
    for r in ranks:
        reports = r["reports"]
        assert len(reports) == STEPS
        assert reports[0]["complete"] and reports[0]["skipped_tensors"] == 0, reports[0]
        out.append(reports)
    return out


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_lora_on_q_and_v_sends_the_fused_qkv_and_finds_a_changed_skipped_weight(
    backend: str, checkpoints, tmp_path
) -> None:
    """LoRA r=4 on q_proj/v_proj: delta syncs send each layer's q, k and v (one fused engine module) and nothing else
    that cannot change; before the third sync a frozen down_proj is changed in place on every rank: it is found by
    the check, sent, logged by name, and the engine is exact again."""
    changed = "model.layers.1.mlp.down_proj.weight"
    result = run_grpo(
        checkpoints("qwen2"), tmp_path, backend, "--peft", "--steps", str(STEPS), "--modify-skipped", f"{changed}:2"
    )
    ranks = assert_synced_every_time(result, backend, steps=STEPS)
    for reports in _reports(ranks):
        first, second, third = reports
        assert not second["complete"] and second["bytes"] < first["bytes"], (first, second)
        assert second["skipped_tensors"] > 0 and second["skipped_bytes"] > 0
        assert third["changed_skipped"] == 1 and third["bytes"] > second["bytes"], (second, third)
        print(f"lora q,v {backend}: complete {first['tensors']} tensors {first['bytes']} B; delta {second['tensors']} "
              f"tensors {second['bytes']} B, {second['skipped_tensors']} skipped; check {second['check_seconds'] * 1e3:.1f} "
              f"ms")  # fmt: skip
    assert "1 skipped weight(s) changed since they were last pushed; sending them" in result.log
    assert changed in result.log


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_lora_on_all_linear_layers_skips_norms_and_embedding(backend: str, checkpoints, tmp_path) -> None:
    result = run_grpo(
        checkpoints("qwen2"), tmp_path, backend, "--peft", "--peft-targets", "all-linear", "--steps", str(STEPS)
    )
    ranks = assert_synced_every_time(result, backend, steps=STEPS)
    for reports in _reports(ranks):
        for later in reports[1:]:
            assert not later["complete"] and later["bytes"] < reports[0]["bytes"], later
            assert later["changed_skipped"] == 0
        print(f"lora all-linear {backend}: delta sends {reports[1]['tensors']} of {reports[0]['tensors']} tensors")


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_frozen_embedding_is_skipped_and_unfreezing_it_makes_the_next_sync_complete(
    backend: str, checkpoints, tmp_path
) -> None:
    """The (tied) embedding frozen, everything else trained: delta syncs skip it; on FSDP2 it is unfrozen before the
    third sync, which must then be complete again (and exact)."""
    extra = ["--unfreeze-at", "2"] if backend == "fsdp2" else []
    result = run_grpo(
        checkpoints("qwen2"), tmp_path, backend, "--freeze", "embed_tokens", "--steps", str(STEPS), *extra
    )
    ranks = assert_synced_every_time(result, backend, steps=STEPS)
    for reports in _reports(ranks):
        second, third = reports[1], reports[2]
        assert not second["complete"] and second["skipped_tensors"] == 1, second
        assert second["bytes"] < reports[0]["bytes"]
        if backend == "fsdp2":
            assert third["complete"] and third["skipped_tensors"] == 0, third
        else:
            assert not third["complete"] and third["skipped_tensors"] == 1, third


def test_moe_frozen_experts_skipped_and_a_changed_expert_tensor_sends_the_whole_fused_experts(
    checkpoints, tmp_path
) -> None:
    """Qwen3-MoE with its experts frozen: delta syncs skip them. Before the third sync layer 0's (fused, in
    transformers 5) gate_up_proj is changed in place: all of that layer's experts are sent, down_proj included,
    because vLLM loads every expert's gate, up and down into one fused-experts module."""
    from .helpers import checkpoint_tensor_count

    model_dir = checkpoints("qwen3_moe")
    result = run_grpo(
        model_dir, tmp_path, "fsdp2", "--freeze", "mlp.experts", "--steps", str(STEPS),
        "--modify-skipped", "model.layers.0.mlp.experts.gate_up_proj:2",
    )  # fmt: skip
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS, dense=False)
    experts = checkpoint_tensor_count(model_dir) - ranks[0]["reports"][1]["tensors"]
    for reports in _reports(ranks):
        first, second, third = reports
        assert not second["complete"] and second["skipped_tensors"] == experts > 0, second
        # Layer 0's experts (gate, up and down of every expert) come back; layer 1's stay skipped.
        assert third["changed_skipped"] == 1 and third["skipped_tensors"] == experts // 2, (second, third)
