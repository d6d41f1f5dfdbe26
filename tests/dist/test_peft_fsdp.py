"""LoRA under FSDP1 and FSDP2 on 2 ranks, with the adapters wrapped as their own FSDP units (as PEFT's FSDP auto-wrap
policy does): the pushed weights equal PEFT's own `merge_and_unload()` of the unsharded model, bit for bit, and the
trainer's weights are left untouched.

Units nested inside a tuner layer (`lora_A`, `lora_B`) are gathered together with the unit that holds the base
weight, so PEFT's `get_delta_weight` sees full adapter weights (`group_units`, `merge_scopes`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import pytest
import torch
from torch import nn

from fsdp_sync.compat.layout import IdentityLayout
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor, TensorSpec
from fsdp_sync.compat.names import NameRules
from fsdp_sync.backend import detect_backend, user_model
from fsdp_sync.config import SyncConfig
from fsdp_sync.gather import make_gatherer
from fsdp_sync.peft_merge import PeftMerge
from fsdp_sync.pipeline import WeightSync
from fsdp_sync._demo.dist import run_distributed

from .models import device, decoder_layer_cls, tiny_lm, train_step


class CapturingWriter:
    """Keeps a copy of every pushed tensor (the engine is not the subject here)."""

    kind = "capture"
    pushes = True
    retains_tensors = False
    engine_dtype = torch.float32

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.expected = expected
        self.got: dict[str, torch.Tensor] = {}

    def manifest(self) -> EngineManifest:
        return EngineManifest({n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.expected.items()},
                              optional=frozenset({"lm_head.weight"}))

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Nothing to announce."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.got = {n: t.detach().to("cpu", copy=True) for n, t in weights}

    def finish(self) -> None:
        """Nothing to reset."""


def _lora_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero adapters, or the merge would be invisible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return model


def _is_adapter_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.requires_grad


def _wrap(model: nn.Module, backend: str, world_size: int) -> nn.Module:
    layer_cls = decoder_layer_cls(user_model(model).get_base_model())
    if backend == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

        policy = functools.partial(
            _or_policy,
            policies=[
                functools.partial(lambda_auto_wrap_policy, lambda_fn=_is_adapter_linear),
                functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
            ],
        )
        return FSDP(model, auto_wrap_policy=policy, device_id=device(), use_orig_params=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (world_size,))
    for module in list(model.modules()):
        if _is_adapter_linear(module):
            fully_shard(module, mesh=mesh)
    for module in list(model.modules()):
        if isinstance(module, layer_cls):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def lora_scenario(rank: int, world_size: int, backend: str, strategy: str) -> dict[str, object]:
    model = _lora_model()
    expected = {k: v.to("cpu", copy=True) for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    expected.pop("lm_head.weight", None)  # tied: sent once, as the embedding
    wrapped = _wrap(model, backend, world_size)
    backend_found = detect_backend(wrapped)
    inner = user_model(wrapped)
    rules = NameRules.for_model(inner)
    config = SyncConfig(fsdp1_strategy=strategy) if backend == "fsdp1" else SyncConfig(fsdp2_strategy=strategy)
    gatherer = make_gatherer(wrapped, backend_found, config, merge_scopes=(PeftMerge.tuner_layer_type(),))
    writer = CapturingWriter(expected)
    sync = WeightSync(gatherer, writer, rules=rules, layout=IdentityLayout(), merge=PeftMerge.for_model(inner, rules))
    units = sum(1 for m in wrapped.modules() if type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")))
    sync.sync()
    first = writer.got
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
    train_step(wrapped, optimizer)
    sync.sync()
    return {
        "units": units,
        "strategy": gatherer.strategy,
        "names": sorted(first) == sorted(expected),
        "equal": {n: torch.equal(first[n], expected[n]) for n in expected if n in first},
        "changed_after_training": any(not torch.equal(writer.got[n], first[n]) for n in first if "q_proj" in n),
    }


@pytest.mark.parametrize("backend,strategy", [("fsdp1", "unit"), ("fsdp1", "flat"), ("fsdp2", "unit"), ("fsdp2", "param")])
def test_lora_merged_push_with_adapter_units(backend: str, strategy: str) -> None:
    for r in run_distributed(lora_scenario, backend, strategy):
        assert r["units"] > 6, "adapters must be FSDP units of their own for this test to mean anything"
        assert r["names"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["changed_after_training"]
        if strategy in ("flat", "param"):
            # The merge needs each layer's adapters full with its base weight, and no collective of its own.
            assert r["strategy"].endswith("-unit"), "PEFT models fall back to the per-unit strategy"
