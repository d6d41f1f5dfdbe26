"""`fsdp_sync.peft_merge.PeftMerge` on real PEFT LoRA models: out-of-place merges equal PEFT's own merge, bit for bit.

The oracle is PEFT itself: `merge_and_unload()` on a deep copy of the same model gives the weights an engine must
receive; `PeftMerge.apply` must give the same tensor from the base weight without touching the trainer's model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_sync.compat.names import NameRules, canonical_name
from fsdp_sync.peft_merge import PeftMerge, UnsupportedAdapterError
from fsdp_sync._demo.models import build_tiny_checkpoint

pytest.importorskip("peft")
pytest.importorskip("transformers")

LAYERS = 2  # the qwen2 tiny spec
QV_WEIGHTS = frozenset(f"model.layers.{i}.self_attn.{p}.weight" for i in range(LAYERS) for p in ("q_proj", "v_proj"))
QV_PATH = "base_model.model.model.layers.{i}.self_attn.{p}"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _lora(
    checkpoint: Path, *, dtype: torch.dtype = torch.float32, lora_b_std: float = 0.05, seed: int = 0, **config: object
) -> nn.Module:
    """A PEFT LoRA model (r=4, alpha=6 on q_proj, v_proj unless overridden) whose lora_B weights are random (not PEFT's
    zeros).

    NOTE: alpha/r = 1.5, not a power of two: multiplying by a power of two is exact, so with alpha/r = 2 a merge that
    scales `lora_B` before the product, or rounds the scaled delta once more, equals PEFT's bit for bit."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype)
    options: dict[str, object] = {"r": 4, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj"], **config}
    model = get_peft_model(base, LoraConfig(**options))
    _randomize_lora_b(model, seed=seed, std=lora_b_std)
    return model


def _randomize_lora_b(model: nn.Module, *, seed: int, std: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)


def _base_weights(model: nn.Module, rules: NameRules) -> dict[str, torch.Tensor]:
    """Every tuner layer's base weight, by checkpoint name."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith(".base_layer.weight"):
            mapped = canonical_name(name, rules)
            assert isinstance(mapped, str)
            out[mapped] = param
    return out


def _peft_merged(model: nn.Module) -> dict[str, torch.Tensor]:
    """What PEFT's own merge gives, by checkpoint name, computed on a deep copy."""
    return dict(copy.deepcopy(model).merge_and_unload().state_dict())


def _merge(model: nn.Module) -> tuple[PeftMerge, NameRules]:
    rules = NameRules.for_model(model)
    return PeftMerge.for_model(model, rules), rules


def _adapters(model: nn.Module, merge: PeftMerge, target: str) -> dict[str, torch.Tensor]:
    """The adapter weights target `target` reads, as a gatherer would deliver them (here: the model's own, full)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        found = merge.adapter_weight(name)
        if found is not None and target in found[0]:
            out[found[1]] = param
    return out


# --- equality with PEFT's merge -----------------------------------------------------------------------------------


def test_names_are_every_layer_q_and_v_projection(qwen2_dir: Path) -> None:
    """The merge targets are exactly the q_proj and v_proj weights of every layer, under checkpoint names."""
    merge, rules = _merge(_lora(qwen2_dir))
    assert rules.peft
    assert merge.names == QV_WEIGHTS


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_apply_equals_peft_merge_and_unload_bit_for_bit(qwen2_dir: Path, rslora: bool) -> None:
    """For every target, apply(name, base weight) equals the weight PEFT's merge_and_unload() produces; with rsLoRA
    too (scaling alpha/sqrt(r) = 3)."""
    model = _lora(qwen2_dir, use_rslora=rslora)
    from peft.tuners.lora import LoraLayer

    scalings = {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)}
    assert scalings == {3.0 if rslora else 1.5}, scalings
    merge, rules = _merge(model)
    reference = _peft_merged(model)
    bases = _base_weights(model, rules)
    for name in sorted(merge.names):
        merged = merge.apply(name, bases[name], _adapters(model, merge, name))
        assert not torch.equal(merged, bases[name]), f"{name}: the delta is zero, the test would prove nothing"
        assert torch.equal(merged, reference[name]), name


def test_adapter_weights_are_found_by_name_however_the_model_is_wrapped(qwen2_dir: Path) -> None:
    """The gatherer's names carry wrapper segments (FSDP1 units around a layer and around `lora_A.default`,
    activation checkpointing, DDP); each adapter weight is still found, with the target it feeds and its name inside
    the layer. Base weights, other parameters and inactive adapters are not adapter weights."""
    from peft import LoraConfig

    model = _lora(qwen2_dir)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"]))
    merge, _ = _merge(model)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    wrapped = {
        "base_model.model.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.lora_A.default.weight":
            ((q0,), "lora_A.default.weight"),
        "module.base_model.model.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.lora_B.default.weight":
            ((q0,), "lora_B.default.weight"),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default._fsdp_wrapped_module.weight":
            ((q0,), "lora_A.default.weight"),
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": None,
        "base_model.model.model.layers.0.self_attn.k_proj.weight": None,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.b.weight": None,  # not active
    }  # fmt: skip
    for name, expected in wrapped.items():
        assert merge.adapter_weight(name) == expected, name
    for target in merge.names:
        assert set(_adapters(model, merge, target)) == {"lora_A.default.weight", "lora_B.default.weight"}, target


def test_apply_reads_the_gathered_adapter_weights_not_the_layers(qwen2_dir: Path) -> None:
    """Under the flat strategies a tuner layer's registered adapter weights are shards; the delta must come from the
    full tensors the gather delivered. Here the layer's own adapter weights are zeroed after the gather: the merge
    still equals PEFT's merge of the gathered values."""
    model = _lora(qwen2_dir)
    merge, rules = _merge(model)
    reference = _peft_merged(model)
    gathered = {name: {k: v.detach().clone() for k, v in _adapters(model, merge, name).items()} for name in merge.names}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.zero_()
    bases = _base_weights(model, rules)
    for name in sorted(merge.names):
        assert torch.equal(merge.apply(name, bases[name], gathered[name]), reference[name]), name


def test_apply_never_modifies_the_base_weight(qwen2_dir: Path) -> None:
    """apply() returns a new tensor and leaves the model's own base weight (values and storage) untouched."""
    model = _lora(qwen2_dir)
    merge, rules = _merge(model)
    bases = _base_weights(model, rules)
    before = {name: t.detach().clone() for name, t in bases.items()}
    for name in sorted(merge.names):
        merged = merge.apply(name, bases[name], _adapters(model, merge, name))
        assert merged.data_ptr() != bases[name].data_ptr()
    for name, tensor in bases.items():
        assert torch.equal(tensor, before[name]), name
    assert not any(m.merged_adapters for m in model.modules() if isinstance(m, PeftMerge.tuner_layer_type()))


def test_apply_is_repeatable(qwen2_dir: Path) -> None:
    """Two applies on the same base weight give the same values (no drift, unlike merge then unmerge)."""
    model = _lora(qwen2_dir)
    merge, rules = _merge(model)
    base = _base_weights(model, rules)["model.layers.1.self_attn.v_proj.weight"]
    name = "model.layers.1.self_attn.v_proj.weight"
    first = merge.apply(name, base, _adapters(model, merge, name))
    second = merge.apply(name, base, _adapters(model, merge, name))
    assert torch.equal(first, second)


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.k_proj.weight"])
def test_non_target_comes_back_unchanged(qwen2_dir: Path, name: str) -> None:
    """A name that is not a merge target is returned as the very same tensor object."""
    merge, _ = _merge(_lora(qwen2_dir))
    tensor = torch.randn(4)
    assert merge.apply(name, tensor, {}) is tensor


# --- which layers are targets ------------------------------------------------------------------------------------


def test_disabled_adapters_give_no_targets(qwen2_dir: Path) -> None:
    """Inside `disable_adapter()` no layer is a target; after it, every layer is again."""
    model = _lora(qwen2_dir)
    with model.disable_adapter():
        merge, _ = _merge(model)
        assert merge.names == frozenset()
    merge, _ = _merge(model)
    assert merge.names == QV_WEIGHTS


def test_layer_with_adapters_disabled_is_not_a_target(qwen2_dir: Path) -> None:
    """A single tuner layer with its adapters disabled is left out; the other layers are still targets."""
    model = _lora(qwen2_dir)
    modules = dict(model.named_modules())
    modules[QV_PATH.format(i=0, p="q_proj")].enable_adapters(False)
    merge, _ = _merge(model)
    assert merge.names == QV_WEIGHTS - {"model.layers.0.self_attn.q_proj.weight"}


def test_merged_adapters_give_no_targets(qwen2_dir: Path) -> None:
    """After `merge_adapter()` the base weights already hold the deltas: no layer is a target."""
    model = _lora(qwen2_dir)
    model.merge_adapter()
    merge, _ = _merge(model)
    assert merge.names == frozenset()


def test_layer_already_merged_is_not_a_target(qwen2_dir: Path) -> None:
    """One layer merged in place is left out (its delta is not added twice); its name passes through unchanged."""
    model = _lora(qwen2_dir)
    modules = dict(model.named_modules())
    layer = modules[QV_PATH.format(i=1, p="v_proj")]
    layer.merge()
    merge, _ = _merge(model)
    name = "model.layers.1.self_attn.v_proj.weight"
    assert merge.names == QV_WEIGHTS - {name}
    merged_base = layer.base_layer.weight
    assert merge.apply(name, merged_base, {}) is merged_base


def test_two_active_adapters_both_added_like_peft(qwen2_dir: Path) -> None:
    """With two active adapters, both deltas are added, equal to PEFT's merge of both."""
    from peft import LoraConfig

    model = _lora(qwen2_dir)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"]))
    _randomize_lora_b(model, seed=1)
    model.base_model.set_adapter(["default", "b"])
    merge, rules = _merge(model)
    assert merge.names == QV_WEIGHTS
    reference = _peft_merged(model)
    bases = _base_weights(model, rules)
    modules = dict(model.named_modules())
    for name in sorted(merge.names):
        merged = merge.apply(name, bases[name], _adapters(model, merge, name))
        assert torch.equal(merged, reference[name]), name
    q0 = "model.layers.0.self_attn.q_proj.weight"
    only_default = bases[q0] + modules[QV_PATH.format(i=0, p="q_proj")].get_delta_weight("default")
    assert not torch.equal(merge.apply(q0, bases[q0], _adapters(model, merge, q0)), only_default)  # adapter "b" contributed


def test_inactive_second_adapter_is_ignored(qwen2_dir: Path) -> None:
    """An adapter that exists but is not active adds nothing; the merge equals PEFT's merge of the active one."""
    from peft import LoraConfig

    model = _lora(qwen2_dir)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj"]))
    _randomize_lora_b(model, seed=1)
    merge, rules = _merge(model)
    reference = _peft_merged(model)
    bases = _base_weights(model, rules)
    for name in sorted(merge.names):
        assert torch.equal(merge.apply(name, bases[name], _adapters(model, merge, name)), reference[name]), name


def test_plain_model_has_no_targets(qwen2_dir: Path) -> None:
    """A model without tuner layers gives non-PEFT rules and no merge targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir))
    rules = NameRules.for_model(model)
    assert not rules.peft
    assert PeftMerge.for_model(model, rules).names == frozenset()


# --- unsupported adapters ------------------------------------------------------------------------------------------


def test_dora_is_rejected_naming_every_layer(qwen2_dir: Path) -> None:
    """DoRA (not an additive delta) raises UnsupportedAdapterError listing every DoRA layer."""
    model = _lora(qwen2_dir, use_dora=True)
    with pytest.raises(UnsupportedAdapterError) as err:
        _merge(model)
    message = str(err.value)
    for i in range(LAYERS):
        for p in ("q_proj", "v_proj"):
            assert QV_PATH.format(i=i, p=p) in message
    assert "4 adapter layer(s)" in message


def test_trainable_tokens_are_rejected(qwen2_dir: Path) -> None:
    """LoRA with `trainable_token_indices` (PEFT TrainableTokens) raises UnsupportedAdapterError naming the layer."""
    model = _lora(qwen2_dir, trainable_token_indices=[0, 1])
    with pytest.raises(UnsupportedAdapterError) as err:
        _merge(model)
    assert "base_model.model.model.embed_tokens.token_adapter (TrainableTokensLayer)" in str(err.value)


def test_tuner_layer_type_is_peft_base_tuner_layer() -> None:
    """tuner_layer_type() is PEFT's BaseTunerLayer (the gatherers' merge scope)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert PeftMerge.tuner_layer_type() is BaseTunerLayer


# --- known bugs ----------------------------------------------------------------------------------------------------


def test_bf16_base_with_fp32_adapter_equals_peft_merge(qwen2_dir: Path) -> None:
    """With a bf16 base model (PEFT keeps LoRA weights in fp32 by default), apply() equals PEFT's merge bit for bit."""
    model = _lora(qwen2_dir, dtype=torch.bfloat16, lora_b_std=0.3)
    merge, rules = _merge(model)
    bases = _base_weights(model, rules)
    assert all(t.dtype == torch.bfloat16 for t in bases.values())
    assert any(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_B." in n)
    reference = _peft_merged(model)
    for name in sorted(merge.names):
        assert torch.equal(merge.apply(name, bases[name], _adapters(model, merge, name)), reference[name]), name


def test_lora_bias_is_merged_or_rejected(qwen2_dir: Path) -> None:
    """A LoRA adapter with a trained bias (`lora_bias=True`) either has its bias merged like PEFT, or is rejected."""
    model = _lora(qwen2_dir, lora_bias=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name and name.endswith(".bias"):
                param.normal_(0, 0.05)
    try:
        merge, rules = _merge(model)
    except UnsupportedAdapterError:
        return
    reference = _peft_merged(model)
    biases = {
        canonical_name(n, rules): p for n, p in model.named_parameters() if n.endswith(".base_layer.bias")
    }
    assert set(biases) == {n.removesuffix(".weight") + ".bias" for n in QV_WEIGHTS}
    for name, bias in sorted(biases.items()):
        assert torch.equal(merge.apply(name, bias, _adapters(model, merge, name)), reference[name]), name


# --- in the stream -------------------------------------------------------------------------------------------------


class _OrderWriter:
    """Records what it receives, in order (a server-mode writer announces this order before the push)."""

    kind = "order"
    pushes = True
    retains_tensors = False
    engine_dtype = torch.float32

    def __init__(self) -> None:
        self.got: list[tuple[str, torch.Tensor]] = []

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.got = [(n, t.detach().clone()) for n, t in weights]


def test_stream_keeps_the_gather_order_while_a_merge_waits_for_its_adapters(qwen2_dir: Path) -> None:
    """A layer's base weight is gathered before its adapters (model order), so its merge waits; the tensors after it
    (the layer's bias, the next layers) must wait too, or the stream's order would differ from the plan's, which
    server mode announces before sending. Every merged weight equals PEFT's merge."""
    from fsdp_sync.distributed import Rounds
    from fsdp_sync.gather import PlainGatherer
    from fsdp_sync.memory import MemoryMeter
    from fsdp_sync.sync.stream import WeightStream

    model = _lora(qwen2_dir)
    merge, rules = _merge(model)
    stream = WeightStream(PlainGatherer(model), rules=rules, merge=merge, meter=MemoryMeter(torch.device("cpu")))
    plan = stream.plan()
    writer = _OrderWriter()
    writer.write(stream.open(plan, Rounds(None)))
    assert [n for n, _ in writer.got] == [t.name for t in plan.tensors]
    reference = _peft_merged(model)
    got = dict(writer.got)
    for name in merge.names:
        assert torch.equal(got[name], reference[name]), name
