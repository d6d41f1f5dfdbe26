"""LoRA under FSDP1 and FSDP2 on 2 ranks, with the adapters wrapped as their own FSDP units (as PEFT's FSDP auto-wrap
policy does): the pushed weights equal PEFT's own `merge_and_unload()` of the unsharded model, bit for bit, and the
trainer's weights are left untouched.

The merge reads the adapter weights the gather delivers (full tensors), so every strategy merges: the per-unit ones
gather units nested inside a tuner layer (`lora_A`, `lora_B`) with the unit that holds the base weight
(`group_units`, `merge_scopes`); the flat ones hold a base weight until its adapters' unit arrives.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import pytest
import torch
from torch import nn

from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor, TensorSpec
from fsdp_sync.assemble import build_sync
from fsdp_sync.backend import user_model
from fsdp_sync.config import SyncConfig
from tests.support.dist import run_distributed

from .models import device, decoder_layer_cls, tiny_lm, train_step


class CapturingWriter:
    """Keeps a copy of every pushed tensor (the engine is not the subject here)."""

    kind = "capture"
    pushes = True
    engine_per_rank = True
    retains_tensors = False

    def __init__(self, expected: dict[str, torch.Tensor], engine_dtype: torch.dtype = torch.float32) -> None:
        self.expected = expected
        self.engine_dtype = engine_dtype
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

    # NOTE: rsLoRA, scaling alpha/sqrt(r) = 3: not a power of two, so a merge that scales in another place or dtype
    # than PEFT's differs from PEFT's merge in some bits.
    lora = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"], use_rslora=True)
    model = get_peft_model(tiny_lm(), lora)
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


def lora_scenario(
    rank: int, world_size: int, backend: str, strategy: str, engine_dtype: torch.dtype = torch.float32
) -> dict[str, object]:
    model = _lora_model()
    # PEFT's merge in the trainer's dtype (fp32), then one cast to the engine's.
    merged = copy.deepcopy(model).merge_and_unload().state_dict().items()
    expected = {k: v.to("cpu", dtype=engine_dtype, copy=True) for k, v in merged}
    expected.pop("lm_head.weight", None)  # tied: sent once, as the embedding
    wrapped = _wrap(model, backend, world_size)
    # Complete syncs (delta off): every weight, each time; delta syncs with LoRA run end to end in tests/e2e.
    options = {f"{backend}_strategy": strategy, "delta": False}
    config = SyncConfig(**options)  # type: ignore[arg-type]
    writer = CapturingWriter(expected, engine_dtype)
    sync = build_sync(wrapped, writer, config, device=device())
    units = sum(1 for m in wrapped.modules() if type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")))
    sync.sync()
    first = writer.got
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
    train_step(wrapped, optimizer)
    sync.sync()
    return {
        "units": units,
        "strategy": sync.stream.gatherer.strategy,
        "names": sorted(first) == sorted(expected),
        "equal": {n: torch.equal(first[n], expected[n]) for n in expected if n in first},
        "changed_after_training": any(not torch.equal(writer.got[n], first[n]) for n in first if "q_proj" in n),
    }


@pytest.mark.parametrize(
    "backend,strategy",
    [("fsdp1", "unit"), ("fsdp1", "flat"), ("fsdp1", "root"), ("fsdp2", "unit"), ("fsdp2", "flat"), ("fsdp2", "param")],
)
def test_lora_merged_push_with_adapter_units(backend: str, strategy: str) -> None:
    """Every strategy merges (the merge reads the adapter weights the gather delivers, so none falls back to the
    per-unit one); the adapters are units of their own, gathered a unit after their base weights."""
    for r in run_distributed(lora_scenario, backend, strategy):
        assert r["units"] > 6, "adapters must be FSDP units of their own for this test to mean anything"
        assert r["names"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["changed_after_training"]
        assert r["strategy"] == f"{backend}-{strategy}"


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_lora_merge_is_rounded_to_a_bf16_engine_once(backend: str) -> None:
    """The flat strategies cast shards to the engine dtype before the all-gather; the weights the merge reads must not
    be (bf16(W) + bf16(B) @ bf16(A) is not bf16(W + B @ A)). With a bf16 engine and an fp32 model, every pushed
    weight equals PEFT's fp32 merge cast to bf16, bit for bit."""
    for r in run_distributed(lora_scenario, backend, "flat", torch.bfloat16):
        assert r["names"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["strategy"] == f"{backend}-flat"
