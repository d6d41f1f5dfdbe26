"""Delta syncs (`fsdp_sync.sync.delta`, `SyncConfig(delta=True)`): the engine grouping, the fingerprints, and the
pipeline's choice of what each sync sends, with the fake gatherer and writer of `test_pipeline.py`.

The end-to-end tests (`tests/e2e/test_delta.py`) check the same on the real vLLM CPU engine, bit for bit.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming
from fsdp_sync.compat.manifest import PlannedTensor, TensorSpec
from fsdp_sync.sync.delta import DeltaTracker, EngineGroups
from fsdp_sync.sync.fingerprint import fingerprints
from fsdp_sync.assemble import policy_for
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.config import SyncConfig
from fsdp_sync.report import DeltaFigures, SyncReport

from .test_pipeline import EMBED, NORM, Q_PROJ, WRAPPED_EMBED, WRAPPED_NORM, WRAPPED_Q_PROJ, FakeGatherer, FakeWriter
from .test_pipeline import _manifest_for, _tensors

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_engine_groups_follow_the_packed_mapping_and_the_engines_fused_experts() -> None:
    layer = "model.layers.0"
    # vLLM 0.32's Qwen3-MoE: the experts' module is `...mlp.experts.routed_experts` (w13_weight, w2_weight).
    modules = [f"{layer}.mlp.experts.routed_experts", f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn.o_proj",
               f"{layer}.mlp.gate_up_proj", "model.embed_tokens"]  # fmt: skip
    groups = EngineGroups(EngineNaming(PACKED), modules)
    assert groups.group(f"{layer}.self_attn.q_proj.weight") == f"{layer}.self_attn.qkv_proj"
    assert groups.group(f"{layer}.self_attn.v_proj.bias") == f"{layer}.self_attn.qkv_proj"
    assert groups.group(f"{layer}.self_attn.o_proj.weight") == f"{layer}.self_attn.o_proj"
    assert groups.group(f"{layer}.mlp.gate_proj.weight") == f"{layer}.mlp.gate_up_proj"
    # Fused experts: the engine owns `...mlp.experts`; every expert's tensors go together.
    assert groups.group(f"{layer}.mlp.experts.3.gate_proj.weight") == f"{layer}.mlp.experts"
    assert groups.group(f"{layer}.mlp.experts.0.down_proj.weight") == f"{layer}.mlp.experts"
    assert groups.group("model.embed_tokens.weight") == "model.embed_tokens"


def test_engine_groups_of_a_vision_language_model_rename_and_fall_back_to_the_parent_module() -> None:
    """vLLM 0.32's Qwen2-VL: its weights mapper moves `model.*` to `language_model.model.*`, and the model class
    declares no packed mapping (its language model does). Renamed, with the mapping: exact groups. Renamed, without
    it (server mode reads the class only): q, k and v still go together, with their parent module."""
    from fsdp_sync._demo.no_torchvision import install

    install()  # vLLM's Qwen2-VL module imports a torchvision-backed transformers module
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    from fsdp_sync.compat.engine_api import engine_name_mapper, packed_modules_for_architectures

    assert packed_modules_for_architectures(["Qwen2VLForConditionalGeneration"]) == {}
    to_engine = engine_name_mapper(Qwen2VLForConditionalGeneration)
    assert to_engine is not None
    to_engine = pickle.loads(pickle.dumps(to_engine))  # the grouping is broadcast from rank 0
    layer = "language_model.model.layers.0"
    modules = [f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn.o_proj", f"{layer}.mlp.gate_up_proj",
               f"{layer}.mlp.down_proj", "visual.blocks.0.attn.qkv", "language_model.model.embed_tokens"]  # fmt: skip
    exact = EngineGroups(EngineNaming(PACKED, to_engine), modules)
    assert exact.group("model.layers.0.self_attn.k_proj.weight") == f"{layer}.self_attn.qkv_proj"
    assert exact.group("model.layers.0.self_attn.o_proj.weight") == f"{layer}.self_attn.o_proj"
    assert exact.group("visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv"
    assert exact.group("model.embed_tokens.weight") == "language_model.model.embed_tokens"
    coarse = EngineGroups(EngineNaming({}, to_engine), modules)
    qkv = {coarse.group(f"model.layers.0.self_attn.{m}_proj.weight") for m in "qkv"}
    assert qkv == {f"{layer}.self_attn"}
    assert coarse.group("model.layers.0.mlp.up_proj.weight") == coarse.group("model.layers.0.mlp.gate_proj.weight")
    assert coarse.group("model.layers.0.mlp.down_proj.weight") == f"{layer}.mlp.down_proj"
    # Without the renaming, a Qwen2-VL name matches no engine module and no parent: the check above is not vacuous.
    unrenamed = EngineGroups(EngineNaming(), modules)
    assert unrenamed.group("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj"


def test_engine_name_mapper_keeps_the_parts_of_fused_modules() -> None:
    """vLLM 0.32's Llama mapper stacks `.q_proj` into `.qkv_proj` (losing which part a tensor is); that is left to the
    packed mapping, so a model that renames nothing else has no mapper at all."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from fsdp_sync.compat.engine_api import _map_name_method, engine_name_mapper

    stacked = _map_name_method(LlamaForCausalLM.hf_to_vllm_mapper)("model.layers.0.self_attn.q_proj.weight")
    assert stacked.endswith("qkv_proj.weight")
    assert engine_name_mapper(LlamaForCausalLM) is None


def test_packed_modules_read_the_components_of_the_engine_model() -> None:
    """vLLM's own `get_packed_modules_mapping`: a model without a mapping of its own takes its components'."""
    from fsdp_sync.compat.engine_api import packed_modules

    class LanguageModel(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    class VisionLanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language_model = LanguageModel()

    assert packed_modules(VisionLanguageModel()) == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def _planned(names: list[str]) -> list[PlannedTensor]:
    return [PlannedTensor(n, TensorSpec((4, 4), torch.float32), (f"t.{n}",)) for n in names]


def test_a_trainable_part_of_a_fused_module_sends_the_whole_module() -> None:
    """LoRA on q_proj and v_proj only: k_proj and the biases of the same fused qkv_proj are sent too (a layer given
    part of its weights is processed from what it has); o_proj, the MLP and the norm are skipped and watched."""
    layer = "model.layers.0"
    names = [
        f"{layer}.self_attn.{m}.{leaf}" for m in ("q_proj", "k_proj", "v_proj") for leaf in ("weight", "bias")
    ] + [f"{layer}.self_attn.o_proj.weight", f"{layer}.mlp.gate_proj.weight", "model.norm.weight"]
    planned = _planned(names)
    trainable = frozenset()
    merge = frozenset({f"{layer}.self_attn.q_proj.weight", f"{layer}.self_attn.v_proj.weight"})
    tracker = DeltaTracker(planned, trainable, merge, EngineGroups(EngineNaming(PACKED), ()))
    assert tracker.always == frozenset(names[:6])
    assert tracker.watched == tuple(sorted(f"t.{n}" for n in names[6:]))
    selection = tracker.select([])
    assert [t.name for t in selection.tensors] == names[:6]
    assert [t.name for t in selection.skipped] == names[6:]
    # A skipped weight found changed is sent with its whole module (gate_proj widens to gate_up_proj: up_proj is
    # not in this plan, so gate_proj alone).
    changed = tracker.select([f"t.{layer}.mlp.gate_proj.weight"])
    assert f"{layer}.mlp.gate_proj.weight" in {t.name for t in changed.tensors}
    assert changed.changed == (f"t.{layer}.mlp.gate_proj.weight",)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size", [1000, 3 * 8191 + 17])  # below and above the sums' period, with a tail
def test_fingerprints_see_one_changed_element_and_a_swap(dtype: torch.dtype, size: int) -> None:
    """Both fingerprints (CRC-32 on the CPU; position-weighted int64 sums, used on accelerators, run here on the
    CPU) change with one changed element and with two swapped ones, and are equal for equal tensors."""
    from fsdp_sync.sync.fingerprint import _crc_fingerprint, _sum_fingerprint

    torch.manual_seed(0)
    base = torch.randn(size, dtype=dtype)
    one = base.clone()
    one[size - 5] = one[size - 5] + 1
    swapped = base.clone()
    swapped[[3, size - 3]] = base[[size - 3, 3]]
    for fingerprint in (_crc_fingerprint, _sum_fingerprint):
        a, b, c, d = (fingerprint(t) for t in (base, base.clone(), one, swapped))
        assert torch.equal(a, b)
        assert not torch.equal(a, c) and not torch.equal(a, d), fingerprint.__name__
    names, prints = fingerprints([("x", base)])
    assert names == ["x"] and torch.equal(prints[0], _crc_fingerprint(base))


def test_the_accelerators_fingerprint_takes_a_shard_that_starts_between_words() -> None:
    """A float32 shard at an odd offset of its flat buffer (4-byte aligned, not 8) cannot be viewed as int64 words: the
    sums take it by element, and still see one changed element. Found on an H100, where the sums run (the CPU takes
    the CRC); computed here on the CPU."""
    from fsdp_sync.sync.fingerprint import _sum_fingerprint

    flat = torch.randn(2 * 8191 + 9)
    shard = flat[1:]
    assert shard.data_ptr() % 8 == 4 and shard.numel() * shard.element_size() % 8 == 0
    before = _sum_fingerprint(shard)
    assert torch.equal(before, _sum_fingerprint(flat.clone()[1:]))
    flat[100] += 1
    assert not torch.equal(before, _sum_fingerprint(shard))


class GroupingWriter(FakeWriter):
    def engine_layout(self) -> EngineLayout:
        return EngineLayout(EngineNaming(PACKED), frozenset())


def _q_proj_trained(**options: bool) -> tuple[dict[str, torch.Tensor], FakeGatherer, GroupingWriter, WeightSync]:
    """The test tensors with only q_proj trainable, behind a delta sync (`options`: WeightSync's)."""
    tensors = _tensors()
    gatherer = FakeGatherer(tensors)
    gatherer.trainable_names = frozenset({WRAPPED_Q_PROJ})
    writer = GroupingWriter(_manifest_for(tensors))
    sync = WeightSync(gatherer, writer, SyncConfig(**{"delta": True, **options}), policy=policy_for)
    return tensors, gatherer, writer, sync


def _delta(report: SyncReport) -> DeltaFigures:
    """The report's delta figures (a sync with `SyncConfig(delta=True)` always has them)."""
    figures = report.figure(DeltaFigures)
    assert figures is not None
    return figures


def test_first_sync_complete_then_only_the_trainable_weights() -> None:
    tensors, gatherer, writer, sync = _q_proj_trained()
    first = sync.sync()
    assert first.complete and _delta(first).skipped_tensors == 0 and first.tensors == 3
    second = sync.sync()
    assert not second.complete
    assert [name for name, _ in writer.received] == [Q_PROJ]
    assert gatherer.selects[-1] == frozenset({WRAPPED_Q_PROJ}), "only the needed units are gathered"
    assert _delta(second).skipped_tensors == 2 and _delta(second).skipped_bytes == (16 * 8 + 8) * 4
    assert second.bytes < first.bytes
    assert writer.prepared == tuple(t for t in sync.checked_plan.tensors if t.name == Q_PROJ)  # type: ignore[union-attr]


def test_a_skipped_weight_changed_in_place_is_found_sent_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    tensors, gatherer, writer, sync = _q_proj_trained()
    sync.sync()
    sync.sync()
    with torch.no_grad():
        tensors[WRAPPED_NORM][2] += 1  # behind the optimizer's back
    with caplog.at_level(logging.WARNING, logger="fsdp_sync.sync.delta"):
        report = sync.sync()
    assert _delta(report).changed_skipped == 1
    assert sorted(name for name, _ in writer.received) == sorted([Q_PROJ, NORM])
    assert torch.equal(dict(writer.received)[NORM], tensors[WRAPPED_NORM])
    assert NORM in caplog.text and "changed since they were last pushed" in caplog.text
    # Its new value is the reference now: the next sync skips it again.
    sync.sync()
    assert [name for name, _ in writer.received] == [Q_PROJ]


def test_trainable_set_changed_makes_the_next_sync_complete() -> None:
    tensors, gatherer, writer, sync = _q_proj_trained()
    sync.sync()
    assert not sync.sync().complete
    gatherer.trainable_names = frozenset({WRAPPED_Q_PROJ, WRAPPED_EMBED})  # requires_grad flipped on the embedding
    report = sync.sync()
    assert report.complete and report.tensors == 3
    assert sorted(n for n, _ in writer.received) == sorted([EMBED, Q_PROJ, NORM])
    again = sync.sync()
    assert not again.complete and sorted(n for n, _ in writer.received) == sorted([EMBED, Q_PROJ])


def test_a_failed_sync_makes_the_next_one_complete() -> None:
    from fsdp_sync.errors import SyncError

    tensors, gatherer, writer, sync = _q_proj_trained()
    sync.sync()
    writer.stop_after = 0
    with pytest.raises(SyncError):
        sync.sync()
    writer.stop_after = None
    assert sync.sync().complete


def test_delta_off_sends_everything_every_time() -> None:
    _, gatherer, writer, sync = _q_proj_trained(delta=False)
    for _ in range(2):
        assert sync.sync().complete and len(writer.received) == 3
    assert gatherer.selects == [None, None]


def test_without_the_check_the_delta_still_applies_after_the_first_sync() -> None:
    """delta_check=False: nothing is fingerprinted, and the syncs after the first are still delta syncs (regression:
    they were all complete)."""
    _, gatherer, writer, sync = _q_proj_trained(delta_check=False)
    assert sync.sync().complete
    report = sync.sync()
    assert not report.complete and [name for name, _ in writer.received] == [Q_PROJ]
    assert _delta(report).check_seconds >= 0 and _delta(report).changed_skipped == 0
