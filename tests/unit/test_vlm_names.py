"""Unit tests: vision-language model names plan to exactly the checkpoint `save_pretrained` writes.

Why: transformers 5 keeps every VLM submodule under `model.` in memory (`model.language_model.*`, `model.visual.*`),
but writes, through `revert_weight_conversion`, each family's older checkpoint layout, the one vLLM's loaders read.
The oracle here is transformers itself: a tiny model built from a config is saved, and the plan built from its
parameters (`build_plan` with `layout_for`) must name and shape every checkpoint tensor, once, and convert to it bit
for bit. Families tested (all renamed between memory and checkpoint):

- llava: `model.language_model.layers.0.self_attn.q_proj.weight`
  -> `language_model.model.layers.0.self_attn.q_proj.weight`
- qwen2_vl: `model.language_model.layers.0.self_attn.q_proj.weight` -> `model.layers.0.self_attn.q_proj.weight`
- gemma3: as llava, with tied embeddings (the checkpoint has no `lm_head`)

NOTE: qwen3_vl, smolvlm and idefics3 save their in-memory names unchanged (identity layout), so they add nothing here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fsdp_sync.compat.layout import TransformersLayout, layout_for
from fsdp_sync.compat.manifest import TensorSpec
from fsdp_sync.compat.names import NameRules
from fsdp_sync.gather.plain import PlainGatherer
from fsdp_sync.sync.stream import SyncPlan, build_plan
from fsdp_sync._demo.models import read_checkpoint

# Token ids inside the tiny vocabulary (the families' defaults point past it).
_VOCAB = 128
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _text(**extra: object) -> dict[str, object]:
    """Kwargs of a tiny text config: 2 layers, hidden size 32, grouped-query attention."""
    return dict(
        vocab_size=_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **_TOKENS,
        **extra,
    )


# A tiny SigLIP / CLIP vision tower: one layer, 16x16 images in 8x8 patches.
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
)


def _llava() -> object:
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config=dict(model_type="llama", **_text()),
        vision_config=dict(model_type="clip_vision_model", projection_dim=16, **_VISION),
        image_token_index=100,
    )


def _qwen2_vl() -> object:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=_text(rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(
            depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=1,
            temporal_patch_size=1,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
    )


def _gemma3() -> object:
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=_text(sliding_window=16),
        vision_config=_VISION,
        mm_tokens_per_image=4,
        image_token_index=100,
        boi_token_index=101,
        eoi_token_index=102,
    )


@dataclass(frozen=True)
class Family:
    """One VLM family: its tiny config and what its checkpoint layout is known to look like.

    Attributes:
        name: the family (test id).
        config: builds the tiny config.
        renamed: an (in-memory name, checkpoint name) pair the family is known to rename.
        lm_head: checkpoint name of the output head; None where it is tied to the input embedding.
        tied_embedding: in-memory name of the embedding the head is tied to (None where untied).
    """

    name: str
    config: Callable[[], object]
    renamed: tuple[str, str]
    lm_head: str | None
    tied_embedding: str | None = None


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llava",
            _llava,
            (
                "model.language_model.layers.1.self_attn.q_proj.weight",
                "language_model.model.layers.1.self_attn.q_proj.weight",
            ),
            lm_head="language_model.lm_head.weight",
        ),
        Family(
            "qwen2_vl",
            _qwen2_vl,
            ("model.language_model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
            lm_head="lm_head.weight",
        ),
        Family(
            "gemma3",
            _gemma3,
            ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight"),
            lm_head=None,
            tied_embedding="model.language_model.embed_tokens.weight",
        ),
    )
}

# A second example per family, from the vision side: the tower moves out of `model.` too.
VISION_RENAMED: dict[str, tuple[str, str]] = {
    "llava": ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"),
    "qwen2_vl": ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),
    "gemma3": ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"),
}


@dataclass(frozen=True)
class Saved:
    """A tiny model built from a config and the checkpoint `save_pretrained` wrote for it."""

    family: Family
    model: torch.nn.Module
    directory: Path
    checkpoint: dict[str, torch.Tensor]



def _build(family: Family) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(family.config(), dtype=torch.float32)


def _load(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(directory), dtype=torch.float32)


def _plan(model: torch.nn.Module) -> SyncPlan:
    """The library's plan for a model the trainer holds as is (single process, no outer wrapper)."""
    return build_plan(PlainGatherer(model), NameRules.for_model(model), layout_for(model))


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}


def _assert_plan_is_checkpoint(plan: SyncPlan, checkpoint: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor is planned once, with its shape and dtype, and nothing else is."""
    planned = [t.name for t in plan.tensors]
    assert len(planned) == len(set(planned)), "a checkpoint name is planned twice"
    assert {t.name: t.spec for t in plan.tensors} == _specs(checkpoint)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """A tiny model of each family, built from its config, and its checkpoint."""
    family = FAMILIES[request.param]
    model = _build(family)
    directory = tmp_path_factory.mktemp(family.name)
    model.save_pretrained(str(directory))
    return Saved(family, model, directory, read_checkpoint(directory))


@pytest.fixture(scope="module", params=["from_config", "from_pretrained"])
def trainer_model(request: pytest.FixtureRequest, saved: Saved) -> torch.nn.Module:
    """The model as a trainer may hold it: built from the config, or loaded from the checkpoint (with conversions)."""
    return saved.model if request.param == "from_config" else _load(saved.directory)


# --- the checkpoint really is renamed ------------------------------------------------------------------------------


def test_in_memory_names_differ_from_checkpoint(saved: Saved) -> None:
    """The family renames on save: the known examples are in memory only and in the checkpoint only."""
    params = dict(saved.model.named_parameters())
    for memory, checkpoint in (saved.family.renamed, VISION_RENAMED[saved.family.name]):
        assert memory in params and memory not in saved.checkpoint
        assert checkpoint in saved.checkpoint and checkpoint not in params
    assert len(params) == len(saved.checkpoint)  # renamed one to one, no tensor split or fused
    assert set(params) != set(saved.checkpoint)


def test_model_source_decides_weight_conversions(trainer_model: torch.nn.Module, saved: Saved) -> None:
    """A built model has no `_weight_conversions`, a loaded one has; both get `TransformersLayout` on the model."""
    conversions = getattr(trainer_model, "_weight_conversions", None)
    if trainer_model is saved.model:
        assert conversions is None
    else:
        assert conversions  # the renamings used to load the checkpoint, kept for the reverse
    layout = layout_for(trainer_model)
    assert isinstance(layout, TransformersLayout)
    assert layout.model is trainer_model


# --- build_plan against the checkpoint -----------------------------------------------------------------------------


def test_plan_matches_checkpoint(trainer_model: torch.nn.Module, saved: Saved) -> None:
    """The plan names, shapes and dtypes exactly the checkpoint's tensors, each from its in-memory parameter."""
    plan = _plan(trainer_model)
    _assert_plan_is_checkpoint(plan, saved.checkpoint)
    assert plan.dropped == ()
    params = [n for n, _ in trainer_model.named_parameters()]
    assert plan.targets == {n: n for n in params}  # no wrapper: the canonical name is the parameter name
    by_name = {t.name: t for t in plan.tensors}
    for memory, checkpoint in (saved.family.renamed, VISION_RENAMED[saved.family.name]):
        assert by_name[checkpoint].sources == (memory,)


def test_convert_matches_checkpoint(trainer_model: torch.nn.Module, saved: Saved) -> None:
    """Converting each parameter after planning gives, bit for bit and in plan order, the checkpoint's tensors."""
    layout = layout_for(trainer_model)
    plan = build_plan(PlainGatherer(trainer_model), NameRules.for_model(trainer_model), layout)
    converted: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in trainer_model.named_parameters():
            for out_name, out in layout.convert(plan.targets[name], param.detach()):
                assert out_name not in converted, f"{out_name} produced twice"
                converted[out_name] = out
    assert list(converted) == [t.name for t in plan.tensors]
    assert set(converted) == set(saved.checkpoint)
    mismatched = [n for n, t in saved.checkpoint.items() if not torch.equal(converted[n], t)]
    assert mismatched == []


def test_lm_head_planned_once_or_not_at_all(trainer_model: torch.nn.Module, saved: Saved) -> None:
    """An untied head is planned under its checkpoint name; a tied head is left out, as in the checkpoint."""
    plan = _plan(trainer_model)
    heads = [t for t in plan.tensors if t.name.endswith("lm_head.weight")]
    family = saved.family
    if family.lm_head is None:
        # NOTE: the head shares the embedding's storage, so `named_parameters` yields it once (as the embedding).
        assert trainer_model.lm_head.weight is trainer_model.get_parameter(family.tied_embedding)
        assert heads == []
        assert not any(n.endswith("lm_head.weight") for n in saved.checkpoint)
    else:
        assert [(t.name, t.sources) for t in heads] == [(family.lm_head, ("lm_head.weight",))]


# --- wrapped trainer models ----------------------------------------------------------------------------------------


def test_wrapped_names_plan_matches_checkpoint(saved: Saved) -> None:
    """Activation checkpointing on the decoder layers plus torch.compile around the model plan the same checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from fsdp_sync.backend import user_model

    model = _build(saved.family)  # a new model: the wrappers are applied in place
    apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__.endswith("DecoderLayer"))
    compiled = torch.compile(model)  # lazy: nothing is compiled until the first forward
    names = [n for n, _ in compiled.named_parameters()]
    memory = saved.family.renamed[0]
    wrapped = "_orig_mod." + memory.replace("layers.1.", "layers.1._checkpoint_wrapped_module.")
    assert wrapped in names

    plan = build_plan(PlainGatherer(compiled), NameRules.for_model(compiled), layout_for(user_model(compiled)))
    _assert_plan_is_checkpoint(plan, saved.checkpoint)
    assert plan.targets[wrapped] == memory
    assert {t.name: t.sources for t in plan.tensors}[saved.family.renamed[1]] == (wrapped,)


def test_peft_lora_plan_matches_checkpoint(saved: Saved) -> None:
    """A LoRA-wrapped VLM plans the base weights under the checkpoint names and drops exactly the adapter weights."""
    peft = pytest.importorskip("peft")

    model = peft.get_peft_model(
        _load(saved.directory), peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"])
    )
    lora = {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert lora  # adapters were injected

    plan = build_plan(PlainGatherer(model), NameRules.for_model(model), layout_for(model))
    _assert_plan_is_checkpoint(plan, saved.checkpoint)
    assert {d.name for d in plan.dropped} == lora
    memory, checkpoint = saved.family.renamed
    base_layer = "base_model.model." + memory.replace("q_proj.weight", "q_proj.base_layer.weight")
    assert plan.targets[base_layer] == memory
    assert {t.name: t.sources for t in plan.tensors}[checkpoint] == (base_layer,)


# --- checkpoints in the hub's layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", ["llava", "gemma3"])
def test_hub_layout_checkpoint_plans_back_to_itself(family_name: str, tmp_path: Path) -> None:
    """Loaded from a checkpoint in the hub's layout (`vision_tower.vision_model.*`), the plan gives that layout back.

    Why: hub CLIP / SigLIP towers keep a `vision_model.` segment that transformers 5 removes at load time and that
    vLLM's loaders need. A model built from a config has no record of it, so `save_pretrained` (and the plan) leave it
    out; a model loaded from a hub checkpoint keeps the removal in `_weight_conversions`, and both put it back.
    """
    from safetensors.torch import save_file

    family = FAMILIES[family_name]
    built = _build(family)
    built.save_pretrained(str(tmp_path / "saved"))
    saved = read_checkpoint(tmp_path / "saved")
    tower = "vision_tower."
    hub = {
        (f"{tower}vision_model.{n[len(tower) :]}" if n.startswith(tower) else n): t.contiguous()
        for n, t in saved.items()
    }
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    shutil.copy(tmp_path / "saved" / "config.json", hub_dir / "config.json")
    save_file(hub, str(hub_dir / "model.safetensors"), metadata={"format": "pt"})

    model = _load(hub_dir)
    memory = VISION_RENAMED[family_name][0]
    assert memory in dict(model.named_parameters())  # the segment is removed in memory
    layout = layout_for(model)
    plan = build_plan(PlainGatherer(model), NameRules.for_model(model), layout)
    _assert_plan_is_checkpoint(plan, hub)
    sources = {t.name: t.sources for t in plan.tensors}
    assert sources[f"{tower}vision_model.encoder.layers.0.mlp.fc1.weight"] == (memory,)
    with torch.no_grad():
        converted = {
            out_name: out
            for name, param in model.named_parameters()
            for out_name, out in layout.convert(plan.targets[name], param.detach())
        }
    assert [n for n, t in hub.items() if not torch.equal(converted[n], t)] == []
