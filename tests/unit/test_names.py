"""Unit tests for `compat.names`: trainer parameter names -> checkpoint names, one rule per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_sync.compat.names import (
    ANYWHERE_WRAPPER_SEGMENTS,
    LORA_ADAPTER_SEGMENTS,
    NON_ENGINE_HEADS,
    Dropped,
    NameRules,
    canonical_name,
    canonical_names,
)

PEFT = NameRules(peft=True)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


# --- wrappers -------------------------------------------------------------------------------------------------------


def test_plain_name_is_unchanged() -> None:
    """A name with no wrapper segment maps to itself."""
    assert canonical_name(Q_PROJ) == Q_PROJ


@pytest.mark.parametrize(
    ("trainer_name", "expected"),
    [
        # FSDP1 root wrapper only.
        ("_fsdp_wrapped_module.model.norm.weight", "model.norm.weight"),
        # FSDP1 root + per-layer wrapper (auto-wrap policy on decoder layers).
        (
            "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight",
            Q_PROJ,
        ),
        # FSDP1 at three depths, including a nested per-linear wrapper.
        (
            "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn."
            "_fsdp_wrapped_module.q_proj.weight",
            Q_PROJ,
        ),
        # Two FSDP1 wrappers directly nested.
        ("_fsdp_wrapped_module._fsdp_wrapped_module.model.norm.weight", "model.norm.weight"),
    ],
)
def test_fsdp1_wrapped_module_removed_at_any_depth(trainer_name: str, expected: str) -> None:
    """Every `_fsdp_wrapped_module` segment is removed, wherever it sits."""
    assert canonical_name(trainer_name) == expected


@pytest.mark.parametrize(
    "trainer_name",
    [
        "model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight",
        "_checkpoint_wrapped_module.model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj._checkpoint_wrapped_module.weight",
    ],
)
def test_checkpoint_wrapped_module_removed(trainer_name: str) -> None:
    """Activation checkpointing's `_checkpoint_wrapped_module` segment is removed at any depth."""
    assert canonical_name(trainer_name) == Q_PROJ


@pytest.mark.parametrize(
    "trainer_name",
    [
        "_orig_mod.model.layers.0.self_attn.q_proj.weight",  # whole model compiled
        "model.layers.0._orig_mod.self_attn.q_proj.weight",  # one layer compiled
        "_orig_mod.model.layers.0._orig_mod.self_attn.q_proj.weight",  # both
    ],
)
def test_orig_mod_removed_leading_and_nested(trainer_name: str) -> None:
    """`torch.compile`'s `_orig_mod` segment is removed both as the leading segment and nested."""
    assert canonical_name(trainer_name) == Q_PROJ


def test_ddp_leading_module_removed() -> None:
    """DDP's leading `module` segment is removed."""
    assert canonical_name("module." + Q_PROJ) == Q_PROJ


def test_ddp_leading_module_after_compile_removed() -> None:
    """A leading `module` after a leading `_orig_mod` (compile around DDP, and the reverse) is removed."""
    assert canonical_name("_orig_mod.module." + Q_PROJ) == Q_PROJ
    assert canonical_name("module._orig_mod." + Q_PROJ) == Q_PROJ


def test_non_leading_module_segment_kept() -> None:
    """A `module` segment that is not leading is a real submodule name and is kept."""
    name = "model.layers.0.module.weight"
    assert canonical_name(name) == name
    assert canonical_name("module." + name) == name


@pytest.mark.parametrize(
    "trainer_name",
    [
        "model.my_orig_mod_layer.weight",
        "model._orig_mod_extra.weight",
        "model.x_fsdp_wrapped_module.weight",
        "model._checkpoint_wrapped_module_2.weight",
        "model.submodule.weight",
        "modules.layers.0.weight",
    ],
)
def test_segment_containing_wrapper_name_untouched(trainer_name: str) -> None:
    """A segment that merely contains a wrapper name as a substring is not altered."""
    assert canonical_name(trainer_name) == trainer_name
    assert canonical_name(trainer_name, PEFT) == trainer_name


def test_extra_wrapper_segments_removed() -> None:
    """`NameRules.extra_wrapper_segments` adds wrapper segments removed at any depth."""
    rules = NameRules(extra_wrapper_segments=frozenset({"_my_wrapper"}))
    assert canonical_name("model.layers.0._my_wrapper.self_attn.q_proj.weight", rules) == Q_PROJ
    assert canonical_name("model.layers.0._my_wrapper.self_attn.q_proj.weight") != Q_PROJ


def test_declared_wrapper_table() -> None:
    """The anywhere-wrapper table holds exactly the three wrappers stripped at any depth."""
    assert ANYWHERE_WRAPPER_SEGMENTS == {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


# --- PEFT -----------------------------------------------------------------------------------------------------------


def test_peft_root_prefix_removed() -> None:
    """PEFT's leading `base_model.model.` pair is removed."""
    assert canonical_name("base_model.model.model.norm.weight", PEFT) == "model.norm.weight"
    assert canonical_name("base_model.model.lm_head.weight", PEFT) == "lm_head.weight"


def test_peft_base_model_not_leading_kept() -> None:
    """`base_model.model` is removed only as the leading pair, not deeper in the name."""
    name = "model.base_model.model.weight"
    assert canonical_name(name, PEFT) == name


def test_peft_base_layer_removed() -> None:
    """A tuner layer's `base_layer` segment is removed."""
    assert canonical_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", PEFT) == Q_PROJ
    assert (
        canonical_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", PEFT)
        == "model.layers.0.self_attn.q_proj.bias"
    )


@pytest.mark.parametrize(
    "trainer_name",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A.default",
        "base_model.model.model.embed_tokens.lora_embedding_B.default",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
    ],
)
def test_peft_adapter_weights_dropped(trainer_name: str) -> None:
    """LoRA/DoRA adapter weights are dropped with a reason, keeping the full trainer name."""
    result = canonical_name(trainer_name, PEFT)
    assert isinstance(result, Dropped)
    assert result.name == trainer_name
    assert "adapter" in result.reason


def test_peft_adapter_table() -> None:
    """The default adapter table covers LoRA, LoRA-embedding and DoRA weights."""
    expected = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
    assert expected <= LORA_ADAPTER_SEGMENTS


def test_peft_custom_adapter_segment_dropped() -> None:
    """An adapter segment added to `adapter_segments` is dropped too."""
    rules = NameRules(adapter_segments=frozenset({"ia3_l"}), peft=True)
    result = canonical_name("base_model.model.model.layers.0.mlp.down_proj.ia3_l.default", rules)
    assert isinstance(result, Dropped)
    # Without it in the table, the name is mapped, not dropped.
    assert canonical_name("base_model.model.model.layers.0.mlp.down_proj.ia3_l.default", PEFT) == (
        "model.layers.0.mlp.down_proj.ia3_l.default"
    )


def test_peft_modules_to_save_collapsed() -> None:
    """`modules_to_save.<adapter>` is removed, so the trained copy maps to the original name."""
    assert canonical_name("base_model.model.lm_head.modules_to_save.default.weight", PEFT) == "lm_head.weight"
    assert (
        canonical_name("base_model.model.model.embed_tokens.modules_to_save.my_adapter.weight", PEFT)
        == "model.embed_tokens.weight"
    )


def test_peft_original_module_dropped() -> None:
    """`original_module` (the frozen copy beside `modules_to_save`) is dropped with a reason."""
    name = "base_model.model.lm_head.original_module.weight"
    result = canonical_name(name, PEFT)
    assert isinstance(result, Dropped)
    assert result.name == name
    assert "original_module" in result.reason


@pytest.mark.parametrize(
    "trainer_name",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.lm_head.modules_to_save.default.weight",
        "base_model.model.lm_head.original_module.weight",
    ],
)
def test_peft_rules_off_leave_peft_names_alone(trainer_name: str) -> None:
    """With `peft=False` (the default), PEFT-looking names are returned unchanged, never dropped."""
    assert canonical_name(trainer_name, NameRules(peft=False)) == trainer_name
    assert canonical_name(trainer_name) == trainer_name


# --- non-engine heads -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", sorted(NON_ENGINE_HEADS))
def test_non_engine_heads_dropped(head: str) -> None:
    """Parameters of heads the engine lacks (`v_head`, `score`, ...) are dropped with the head named."""
    name = f"{head}.summary.weight"
    result = canonical_name(name)
    assert isinstance(result, Dropped)
    assert result.name == name
    assert f"`{head}`" in result.reason


def test_non_engine_head_dropped_after_wrappers() -> None:
    """A head is recognised on the canonical name, after wrappers and PEFT segments are removed."""
    name = "module.base_model.model.score.modules_to_save.default.weight"
    result = canonical_name(name, PEFT)
    assert isinstance(result, Dropped)
    assert result.name == name
    assert "`score`" in result.reason


def test_head_name_not_leading_kept() -> None:
    """A head segment that is not the first canonical segment is an ordinary name."""
    assert canonical_name("model.score.weight") == "model.score.weight"
    assert canonical_name("model.layers.0.v_head.weight") == "model.layers.0.v_head.weight"


def test_custom_non_engine_heads() -> None:
    """`non_engine_heads` replaces the head table: listed heads drop, others are kept."""
    rules = NameRules(non_engine_heads=frozenset({"mtp"}))
    assert isinstance(canonical_name("mtp.layers.0.weight", rules), Dropped)
    assert canonical_name("v_head.weight", rules) == "v_head.weight"


# --- combinations ---------------------------------------------------------------------------------------------------


def test_combined_wrappers_with_peft() -> None:
    """DDP + compile + FSDP1 + activation checkpointing + PEFT in one name all collapse to the checkpoint name."""
    name = (
        "module._orig_mod._fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module."
        "_checkpoint_wrapped_module.self_attn.q_proj.base_layer.weight"
    )
    assert canonical_name(name, PEFT) == Q_PROJ


def test_combined_wrappers_with_peft_adapter_dropped() -> None:
    """An adapter weight under every wrapper is still dropped, reported under its full trainer name."""
    name = (
        "module._orig_mod._fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module."
        "_checkpoint_wrapped_module.self_attn.q_proj.lora_B.default.weight"
    )
    result = canonical_name(name, PEFT)
    assert isinstance(result, Dropped)
    assert result.name == name


def test_combined_wrappers_with_modules_to_save() -> None:
    """`modules_to_save` under FSDP1 and checkpoint wrappers maps to the plain head name."""
    name = "_fsdp_wrapped_module.base_model.model._checkpoint_wrapped_module.lm_head.modules_to_save.default.weight"
    assert canonical_name(name, PEFT) == "lm_head.weight"


def test_canonical_names_keyed_by_trainer_name() -> None:
    """`canonical_names` maps each trainer name to its `canonical_name` result."""
    names = ["module." + Q_PROJ, "v_head.weight"]
    out = canonical_names(names)
    assert list(out) == names
    assert out["module." + Q_PROJ] == Q_PROJ
    assert isinstance(out["v_head.weight"], Dropped)


def test_peft_trainable_tokens_base_layer_maps_to_embedding() -> None:
    """PEFT `trainable_token_indices` wraps the embedding; its base weight is the checkpoint embedding."""
    name = "base_model.model.model.embed_tokens.token_adapter.base_layer.weight"
    assert canonical_name(name, PEFT) == "model.embed_tokens.weight"


# --- NameRules.for_model on a real PEFT model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 checkpoint (tied embeddings, q/k/v biases), written once for this module."""
    from fsdp_sync._demo.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def qwen2_lora(qwen2_dir: Path) -> torch.nn.Module:
    """The tiny qwen2 model wrapped by PEFT LoRA on q_proj and v_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir))
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"]))


def _checkpoint_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def test_for_model_plain_model_is_not_peft(qwen2_dir: Path) -> None:
    """`for_model` on a model with no tuner layer gives `peft=False` and the default adapter table."""
    from transformers import AutoModelForCausalLM

    rules = NameRules.for_model(AutoModelForCausalLM.from_pretrained(str(qwen2_dir)))
    assert rules.peft is False
    assert rules.adapter_segments == LORA_ADAPTER_SEGMENTS


def test_for_model_detects_peft(qwen2_lora: torch.nn.Module) -> None:
    """`for_model` detects PEFT from tuner layers and includes their declared adapter names."""
    from peft.tuners.lora import LoraLayer

    rules = NameRules.for_model(qwen2_lora)
    assert rules.peft is True
    assert set(LoraLayer.adapter_layer_names) <= rules.adapter_segments


def test_for_model_overrides_applied(qwen2_lora: torch.nn.Module) -> None:
    """Keyword overrides of `for_model` are passed to the rules."""
    rules = NameRules.for_model(qwen2_lora, non_engine_heads=frozenset({"x"}))
    assert rules.non_engine_heads == frozenset({"x"})
    assert rules.peft is True


def test_for_model_peft_names_cover_checkpoint_exactly(qwen2_dir: Path, qwen2_lora: torch.nn.Module) -> None:
    """Every PEFT parameter maps to a checkpoint name or is a dropped adapter; every checkpoint name appears once."""
    checkpoint = _checkpoint_names(qwen2_dir)
    assert "lm_head.weight" not in checkpoint  # tied in the qwen2 tiny model
    rules = NameRules.for_model(qwen2_lora)

    produced: list[str] = []
    dropped: list[Dropped] = []
    for trainer_name, _ in qwen2_lora.named_parameters():
        result = canonical_name(trainer_name, rules)
        if isinstance(result, Dropped):
            dropped.append(result)
        else:
            assert result in checkpoint, f"{trainer_name} -> {result} is not a checkpoint name"
            produced.append(result)

    assert sorted(produced) == sorted(checkpoint)  # each checkpoint name exactly once
    assert len(produced) == len(set(produced))
    # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
    assert len(dropped) == 8
    assert all(("lora_A" in d.name or "lora_B" in d.name) and "adapter" in d.reason for d in dropped)
