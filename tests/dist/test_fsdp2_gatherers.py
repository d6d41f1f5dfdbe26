"""FSDP2 gatherers on 2 gloo ranks: full values equal the unsharded model, before and after training.

Covers per-unit `unshard()` and per-parameter `full_tensor()`, tied embeddings, parameters outside every unit
(plain tensors pass through), mixed precision (bf16 all-gather is used only when the engine is bf16 too), and the
accounted peak memory of the per-unit strategy (one unit at a time).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp_sync.gather import FlatOptions, FSDP2FlatGatherer, FSDP2ParamGatherer, FSDP2UnitGatherer
from fsdp_sync.gather.base import local_named_parameters
from fsdp_sync.memory import MemoryMeter
from tests.support.dist import run_distributed

from .models import device, full_reference, tiny_lm, train_step


def _shard(model: torch.nn.Module, world_size: int, *, shard_root: bool, mp: MixedPrecisionPolicy | None) -> None:
    mesh = init_device_mesh(device().type, (world_size,))
    kwargs = {"mesh": mesh, "mp_policy": mp or MixedPrecisionPolicy()}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if shard_root:
        fully_shard(model, **kwargs)


def _gather(gatherer: object) -> dict[str, torch.Tensor]:
    meter = MemoryMeter(device())
    meter.start()
    out = {n: t.to("cpu", copy=True) for n, t in gatherer.iter_full(meter)}  # type: ignore[attr-defined]
    out["__peak__"] = torch.tensor(meter.accounted_peak_bytes)
    return out


def gather_scenario(
    rank: int, world_size: int, strategy: str, shard_root: bool, mp_dtype: str | None, engine: str, vocab: int = 256
):
    model = tiny_lm(vocab=vocab)
    reference = full_reference(model)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, mp_dtype)) if mp_dtype else None
    _shard(model, world_size, shard_root=shard_root, mp=mp)
    engine_dtype = getattr(torch, engine)
    if strategy == "unit":
        gatherer = FSDP2UnitGatherer(model, engine_dtype=engine_dtype)
    elif strategy == "flat":
        gatherer = FSDP2FlatGatherer(model, FlatOptions(engine_dtype=engine_dtype))
    else:
        gatherer = FSDP2ParamGatherer(model)
    specs = gatherer.specs()
    before = _gather(gatherer)
    peak = int(before.pop("__peak__"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    after = _gather(gatherer)
    after.pop("__peak__")
    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    trained = {k: v.to("cpu") for k, v in trained.items()}
    unit_bytes = [
        sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.modules() if isinstance(m, FSDPModule)
    ]
    return {
        "spec_names": list(specs),
        "yield_names": list(before),
        "reference_names": sorted(reference),
        "before_equal": {n: torch.equal(before[n].to(engine_dtype), reference[n].to(engine_dtype)) for n in before},
        "after_equal": {n: torch.equal(after[n].to(engine_dtype), trained[n].to(engine_dtype)) for n in after},
        "dtypes": sorted({str(t.dtype) for t in after.values()}),
        "reference_dtypes": sorted({str(t.dtype) for t in reference.values()}),
        "spec_shapes_ok": all(tuple(specs[n].shape) == tuple(before[n].shape) for n in specs),
        "peak": peak,
        "model_bytes": sum(t.numel() * t.element_size() for t in reference.values()),
        "largest_unit_bytes": max(unit_bytes),
    }


@pytest.mark.parametrize(
    "strategy,shard_root,mp_dtype,engine",
    [
        ("unit", True, None, "float32"),
        ("param", True, None, "float32"),
        ("unit", False, None, "float32"),  # embeddings, norm, lm_head outside every unit: plain tensors
        ("param", False, None, "float32"),
        ("unit", True, "bfloat16", "bfloat16"),  # bf16 all-gather, bf16 engine: gathered in bf16
        ("unit", True, "bfloat16", "float32"),  # bf16 all-gather would lose bits: full_tensor() in fp32
        ("flat", True, None, "float32"),
        ("flat", True, None, "bfloat16"),  # shards cast to bf16 before the gather
        ("flat", False, None, "bfloat16"),
        ("flat", True, "bfloat16", "float32"),  # reads the fp32 shards, whatever the mixed-precision policy
    ],
)
def test_fsdp2_gather_equals_full_weights(strategy: str, shard_root: bool, mp_dtype: str | None, engine: str) -> None:
    for r in run_distributed(gather_scenario, strategy, shard_root, mp_dtype, engine):
        assert sorted(r["yield_names"]) == r["reference_names"], "every parameter once, tied weights once"
        assert r["spec_names"] == r["yield_names"], "specs() must list names in the order iter_full yields them"
        assert r["spec_shapes_ok"]
        assert all(r["before_equal"].values()), [n for n, ok in r["before_equal"].items() if not ok]
        assert all(r["after_equal"].values()), [n for n, ok in r["after_equal"].items() if not ok]
        if mp_dtype and engine == "float32":
            assert r["dtypes"] == ["torch.float32"], "a lossy bf16 gather was used for an fp32 engine"
        if strategy == "flat" and shard_root:  # (plain tensors outside every unit pass through uncast)
            assert r["dtypes"] == [f"torch.{engine}"], "flat gathers in the engine dtype"
        if strategy == "unit" and shard_root:
            assert 0 < r["peak"] <= r["largest_unit_bytes"] * (2 if mp_dtype else 1), r
            assert r["peak"] < r["model_bytes"]


@pytest.mark.parametrize("strategy", ["flat", "unit", "param"])
def test_fsdp2_uneven_shards(strategy: str) -> None:
    """A vocabulary not divisible by the world size: FSDP2 pads the last shard; the full tensors are exact."""
    for r in run_distributed(gather_scenario, strategy, True, None, "bfloat16", 257):
        assert sorted(r["yield_names"]) == r["reference_names"]
        assert all(r["before_equal"].values()), [n for n, ok in r["before_equal"].items() if not ok]
        assert all(r["after_equal"].values()), [n for n, ok in r["after_equal"].items() if not ok]


def prefetch_scenario(rank: int, world_size: int, prefetch_bytes: int) -> dict[str, int]:
    model = tiny_lm()
    _shard(model, world_size, shard_root=True, mp=None)
    gatherer = FSDP2FlatGatherer(model, FlatOptions(engine_dtype=torch.bfloat16, prefetch_bytes=prefetch_bytes))
    meter = MemoryMeter(device())
    meter.start()
    for _ in gatherer.iter_full(meter):  # each tensor dropped when the next is taken, as a copying writer does
        pass
    unit_bytes = sorted(  # each unit's own parameters, in bf16 (tied weights once)
        sum({id(p): p.numel() * 2 for _, p in local_named_parameters(m, "", FSDPModule)}.values())
        for m in model.modules()
        if isinstance(m, FSDPModule)
    )
    largest_param = max(p.numel() * 2 for p in model.parameters())
    return {
        "peak": meter.accounted_peak_bytes,
        "largest": unit_bytes[-1],
        "two_largest": sum(unit_bytes[-2:]),
        "largest_param": largest_param,
    }


@pytest.mark.parametrize("prefetch_bytes", [0, 2**30])
def test_fsdp2_flat_peak_is_bounded_by_prefetch(prefetch_bytes: int) -> None:
    """Peak gathered bytes: one unit without prefetch, at most two with it; plus the one tensor of the previous unit
    the consumer still holds while it asks for the next (the loop variable)."""
    for r in run_distributed(prefetch_scenario, prefetch_bytes):
        if prefetch_bytes == 0:
            assert 0 < r["peak"] <= r["largest"] + r["largest_param"], r
        else:
            assert r["largest"] + r["largest_param"] < r["peak"] <= r["two_largest"] + r["largest_param"], r
