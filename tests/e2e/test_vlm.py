"""A vision-language model end to end: a tiny Qwen2-VL (built from a config) under FSDP2 on 2 gloo ranks, TRL's
GRPOTrainer with the mixin on text prompts, an in-process vLLM CPU engine on each rank; after every sync every
engine weight, the vision tower's included, equals the trainer's full weight bit for bit, and the engine's logprobs
match the trainer's model.

vLLM serves Qwen2-VL with its language model under `language_model.` (its weights mapper renames the checkpoint's
`model.*`) and declares the fused `qkv_proj`/`gate_up_proj` on that component only, so these runs also check that
delta syncs find whole engine modules through the renaming. The test stack has no torchvision (see
`fsdp_sync._demo.no_torchvision`, put on every rank's PYTHONPATH here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_sync._demo.models import build_tiny_vlm_checkpoint
from fsdp_sync._demo.no_torchvision import SITE_DIR

from .helpers import assert_synced_every_time, checkpoint_tensor_count, run_grpo

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(autouse=True)
def _without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE_DIR), os.environ.get("PYTHONPATH")])))


def _vision_tensors(model_dir: Path) -> int:
    from fsdp_sync._demo.models import read_checkpoint

    return sum(1 for name in read_checkpoint(model_dir) if name.startswith("visual."))


def test_frozen_vision_tower_is_skipped_after_the_first_sync(qwen2_vl: Path, tmp_path: Path) -> None:
    """The common GRPO set-up: the vision tower frozen, the language model trained. The first sync sends every
    tensor; the later ones skip exactly the vision tower's, and the engine stays exact, vision tower included."""
    result = run_grpo(qwen2_vl, tmp_path, "fsdp2", "--freeze", "visual", "--steps", str(STEPS))
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS)
    vision = _vision_tensors(qwen2_vl)
    assert vision > 0
    for r in ranks:
        assert any(n.startswith("model.visual.") for n in r["trainer_names"]), "transformers 5 names: model.visual"
        first, *later = r["reports"]
        assert first["complete"] and first["tensors"] == checkpoint_tensor_count(qwen2_vl), first
        for report in later:
            assert not report["complete"] and report["skipped_tensors"] == vision, report
            assert report["bytes"] < first["bytes"] and report["changed_skipped"] == 0, report
        print(f"qwen2-vl frozen vision: complete {first['tensors']} tensors {first['bytes']} B; delta "
              f"{later[0]['tensors']} tensors {later[0]['bytes']} B")  # fmt: skip


def test_lora_on_q_and_v_sends_whole_fused_modules_through_the_renaming(qwen2_vl: Path, tmp_path: Path) -> None:
    """LoRA on q_proj/v_proj of the language model: each delta sync must send k_proj with q and v (one fused
    `language_model.model.layers.<i>.self_attn.qkv_proj` in the engine); a q/v-only push would leave the k rows
    undefined, which the bit-exact check after every sync would catch."""
    result = run_grpo(qwen2_vl, tmp_path, "fsdp2", "--peft", "--steps", str(STEPS))
    ranks = assert_synced_every_time(result, "fsdp2", steps=STEPS)
    for r in ranks:
        first, second, _ = r["reports"]
        assert not second["complete"] and 0 < second["bytes"] < first["bytes"], second
        # 2 layers x q, k, v x (weight, bias): the fused qkv_proj of each layer, nothing else.
        assert second["tensors"] == 12, second
