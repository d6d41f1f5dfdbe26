"""Unit tests for `compat.layout`: identity layout, layout detection, and transformers' MoE expert reversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_sync.compat.layout import IdentityLayout, TransformersLayout, layout_for
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
from fsdp_sync._demo.models import read_checkpoint



def _canonical(model: torch.nn.Module) -> dict[str, tuple[str, TensorSpec]]:
    """{trainer name: (canonical name, spec)} with canonical name = parameter name (no wrappers)."""
    return {n: (n, TensorSpec(tuple(p.shape), p.dtype)) for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The tiny qwen2 model (no load-time conversions)."""
    from transformers import AutoModelForCausalLM

    from fsdp_sync._demo.models import build_tiny_checkpoint

    directory = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return AutoModelForCausalLM.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_moe checkpoint: experts stored per expert, fused by transformers at load time."""
    from fsdp_sync._demo.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def moe(moe_dir: Path) -> torch.nn.Module:
    """The tiny qwen3_moe model as loaded by transformers (fused experts)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(moe_dir))


# --- IdentityLayout -------------------------------------------------------------------------------------------------


def test_identity_plan_one_tensor_per_name() -> None:
    """The identity plan keeps every canonical name and spec, with the trainer name as the only source."""
    spec_a = TensorSpec((2, 3), torch.float32)
    spec_b = TensorSpec((4,), torch.bfloat16)
    canonical = {"module.a": ("a", spec_a), "_orig_mod.b": ("b", spec_b)}
    tensors, targets = IdentityLayout().plan(canonical)
    assert tensors == [PlannedTensor("a", spec_a, ("module.a",)), PlannedTensor("b", spec_b, ("_orig_mod.b",))]
    assert targets == {"module.a": "a", "_orig_mod.b": "b"}


def test_identity_plan_empty() -> None:
    """An empty mapping plans nothing."""
    assert IdentityLayout().plan({}) == ([], {})


def test_identity_convert_returns_same_tensor() -> None:
    """`convert` yields the one (name, tensor) pair, with the very same tensor object."""
    t = torch.arange(6.0).reshape(2, 3)
    out = list(IdentityLayout().convert("a", t))
    assert len(out) == 1
    assert out[0][0] == "a"
    assert out[0][1] is t


# --- layout_for -----------------------------------------------------------------------------------------------------


def test_layout_for_plain_module_is_identity() -> None:
    """A module that is not a transformers model gets the identity layout."""
    assert isinstance(layout_for(torch.nn.Linear(2, 2)), IdentityLayout)


def test_layout_for_qwen2_is_identity(qwen2: torch.nn.Module) -> None:
    """A transformers model without load-time conversions (qwen2) gets the identity layout."""
    assert isinstance(layout_for(qwen2), IdentityLayout)


def test_layout_for_qwen3_moe_is_transformers(moe: torch.nn.Module) -> None:
    """A model with load-time conversions (qwen3_moe fused experts) gets `TransformersLayout` on the model."""
    layout = layout_for(moe)
    assert isinstance(layout, TransformersLayout)
    assert layout.model is moe


def test_layout_for_looks_through_peft(moe: torch.nn.Module) -> None:
    """An object exposing `get_base_model` (PEFT) is judged by its base model."""

    class Wrapper:
        def get_base_model(self) -> torch.nn.Module:
            return moe

    layout = layout_for(Wrapper())
    assert isinstance(layout, TransformersLayout)
    assert layout.model is moe


# --- TransformersLayout on qwen3_moe --------------------------------------------------------------------------------


def test_qwen3_moe_plan_matches_checkpoint(moe: torch.nn.Module, moe_dir: Path) -> None:
    """Planning the fused model's parameters gives exactly the checkpoint's names and shapes, once each."""
    checkpoint = read_checkpoint(moe_dir)
    canonical = _canonical(moe)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in canonical)  # fused in memory
    assert set(canonical) != set(checkpoint)

    tensors, targets = layout_for(moe).plan(canonical)
    planned = [t.name for t in tensors]
    assert len(planned) == len(set(planned))
    assert {t.name: t.spec.shape for t in tensors} == {n: tuple(t.shape) for n, t in checkpoint.items()}
    assert all(t.spec.dtype == checkpoint[t.name].dtype for t in tensors)
    assert targets == {n: n for n in canonical}
    # Each per-expert tensor names the fused trainer parameter it comes from.
    by_name = {t.name: t for t in tensors}
    up = by_name["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert up.sources == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert by_name["model.layers.1.mlp.experts.0.down_proj.weight"].sources == ("model.layers.1.mlp.experts.down_proj",)
    assert by_name["model.norm.weight"].sources == ("model.norm.weight",)


def test_qwen3_moe_convert_matches_checkpoint(moe: torch.nn.Module, moe_dir: Path) -> None:
    """Converting the real fused tensors gives, bit for bit, the checkpoint's per-expert tensors."""
    checkpoint = read_checkpoint(moe_dir)
    layout = layout_for(moe)
    tensors, _ = layout.plan(_canonical(moe))

    converted: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in moe.named_parameters():
            for out_name, out in layout.convert(name, param.detach()):
                assert out_name not in converted, f"{out_name} produced twice"
                converted[out_name] = out

    assert list(converted) == [t.name for t in tensors]  # convert follows plan order
    assert set(converted) == set(checkpoint)
    mismatched = [n for n, t in checkpoint.items() if not torch.equal(converted[n], t)]
    assert mismatched == []


def test_qwen3_moe_unconverted_tensor_passes_through(moe: torch.nn.Module) -> None:
    """After planning, a tensor with no conversion is passed through as the same object."""
    layout = layout_for(moe)
    layout.plan(_canonical(moe))
    t = dict(moe.named_parameters())["model.norm.weight"].detach()
    out = list(layout.convert("model.norm.weight", t))
    assert len(out) == 1
    assert out[0][0] == "model.norm.weight"
    assert out[0][1] is t
