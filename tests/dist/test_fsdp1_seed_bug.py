"""The seed bug: FSDP1 units summoned child-first before the root's first forward break the first forward.

TRL 1.16 (`VLLMGeneration._iter_fsdp1_params`) walks the model it was given (the module inside the FSDP root)
post-order and calls `summon_full_params(unit, recurse=False)` on each nested unit. Before the first forward, the
first unit summoned marks itself as root, and the real root's first forward then fails. This shows the failure with
that walk, and that the library's per-unit gather (parents first) leaves training working, on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_sync.compat.names import canonical_name
from fsdp_sync.gather import FSDP1FlatGatherer, FSDP1RootSummonGatherer, FSDP1UnitGatherer
from fsdp_sync.memory import MemoryMeter
from tests.support.dist import run_distributed

from .models import device, decoder_layer_cls, full_reference, tiny_lm, train_step


def _wrap(use_orig_params: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = tiny_lm()
    reference = full_reference(model)
    wrapped = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({decoder_layer_cls(model)}),
        device_id=device(),
        use_orig_params=use_orig_params,
    )
    return wrapped, reference


def _trl_child_first_walk(module: torch.nn.Module) -> None:
    """TRL 1.16's order: children before parents, `recurse=False`, on the module TRL holds (inside the root)."""
    for child in module.children():
        _trl_child_first_walk(child)
    if isinstance(module, FSDP):
        with FSDP.summon_full_params(module, recurse=False, writeback=False):
            pass


def child_first_then_train(rank: int, world_size: int, use_orig_params: bool) -> str:
    wrapped, _ = _wrap(use_orig_params)
    _trl_child_first_walk(wrapped._fsdp_wrapped_module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    try:
        train_step(wrapped, optimizer)
    except AssertionError as e:
        return str(e)
    return "no error"


def gather_then_train(rank: int, world_size: int, use_orig_params: bool, strategy: str) -> dict[str, object]:
    wrapped, reference = _wrap(use_orig_params)
    gatherer_cls = {"unit": FSDP1UnitGatherer, "root": FSDP1RootSummonGatherer, "flat": FSDP1FlatGatherer}[strategy]
    gatherer = gatherer_cls(wrapped)
    meter = MemoryMeter(device())
    meter.start()
    before = {canonical_name(n): t.to("cpu", copy=True) for n, t in gatherer.iter_full(meter)}
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    losses = [train_step(wrapped, optimizer, seed=s) for s in range(2)]
    after = {canonical_name(n): t.to("cpu", copy=True) for n, t in gatherer.iter_full(meter)}
    with FSDP.state_dict_type(wrapped, torch.distributed.fsdp.StateDictType.FULL_STATE_DICT):
        trained = {k: v.to("cpu", copy=True) for k, v in wrapped.state_dict().items()}
    return {
        "names_before": sorted(before),
        "reference_names": sorted(reference),
        "before_equal": all(torch.equal(before[n], reference[n]) for n in reference if n in before),
        "after_equal": all(torch.equal(after[n], trained[n]) for n in after),
        "changed": all(not torch.equal(after[n], before[n]) for n in after if n.endswith("q_proj.weight")),
        "losses": losses,
    }


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_child_first_summon_breaks_first_forward(use_orig_params: bool) -> None:
    messages = run_distributed(child_first_then_train, use_orig_params)
    for message in messages:
        assert "Non-root FSDP instance's `_is_root` should not have been set yet" in message, message


@pytest.mark.parametrize("strategy", ["unit", "root", "flat"])
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_library_gather_before_first_forward_then_training_works(use_orig_params: bool, strategy: str) -> None:
    for rank_result in run_distributed(gather_then_train, use_orig_params, strategy):
        assert rank_result["names_before"] == rank_result["reference_names"]
        assert rank_result["before_equal"], "gathered weights differ from the unsharded model"
        assert rank_result["after_equal"], "gathered weights differ from FSDP's full state dict after training"
        assert rank_result["changed"], "training did not change the weights; the check would be vacuous"
        assert all(torch.isfinite(torch.tensor(rank_result["losses"])))
