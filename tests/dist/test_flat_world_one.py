"""The flat gatherers at world size 1 (one GPU, the benchmarks' case), where nothing is gathered: the full weights
are the units' own flat parameters (FSDP1) or the parameters' local tensors (FSDP2), handed on as they are.

FSDP1 keeps the views of a unit's own flat parameter between syncs (`FSDP1FlatGatherer._unflat_views`): after a
training step they must show the new values (they are views, not copies), and a unit cast on the way (float32
parameters, a bfloat16 engine) must never be kept (it is a fresh buffer every sync).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.support.dist import run_distributed
from fsdp_sync.compat.names import canonical_name
from fsdp_sync.gather import FSDP1FlatGatherer, FSDP2FlatGatherer, FlatOptions
from fsdp_sync.memory import MemoryMeter

from .models import decoder_layer_cls, device, tiny_lm, train_step


def _wrap(backend: str, dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_lm().to(dtype)
    if backend == "fsdp1":
        policy = ModuleWrapPolicy({decoder_layer_cls(model)})
        return FSDP(model, auto_wrap_policy=policy, device_id=device(), use_orig_params=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(wrapped: torch.nn.Module, engine: torch.dtype) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    return {canonical_name(k): v.detach().to(engine).cpu() for k, v in state.items()}


def two_syncs(rank: int, world_size: int, backend: str, params: str) -> dict[str, object]:
    dtype, engine = getattr(torch, params), torch.bfloat16
    wrapped = _wrap(backend, dtype)
    cls = FSDP1FlatGatherer if backend == "fsdp1" else FSDP2FlatGatherer
    gatherer = cls(wrapped, FlatOptions(engine_dtype=engine))
    meter = MemoryMeter(device())
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    results = []
    for step in range(2):
        train_step(wrapped, optimizer, seed=step)
        gathered = list(gatherer.iter_full(meter))
        reference = _full(wrapped, engine)
        got = {canonical_name(n): t.detach().cpu() for n, t in gathered}
        results.append({
            "names": len(got) == len(gathered) == len(list(wrapped.parameters())) and set(got) <= set(reference),
            "equal": all(torch.equal(got[n].view(torch.int16), reference[n].view(torch.int16)) for n in got),
            "ids": [id(t) for _, t in gathered],
        })  # fmt: skip
    kept = len(getattr(gatherer, "_views", {}))
    return {"results": results, "kept": kept, "same_views": results[0]["ids"] == results[1]["ids"]}


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("params", ["bfloat16", "float32"])
def test_world_size_one_hands_on_the_current_weights(backend: str, params: str) -> None:
    (out,) = run_distributed(two_syncs, backend, params, world_size=1)
    for result in out["results"]:
        assert result["names"] and result["equal"], result
    if backend == "fsdp1" and params == "bfloat16":
        assert out["kept"] == 3 and out["same_views"], "the units' own flat parameters: views kept between syncs"
    if backend == "fsdp1" and params == "float32":
        assert out["kept"] == 0 and not out["same_views"], "cast on the way: fresh buffers, nothing kept"


def unsharded_root(rank: int, world_size: int) -> dict[str, object]:
    """A flat gatherer made after a forward (FSDP2 leaves the root unsharded until a backward), a sync after the
    root was resharded."""
    wrapped = _wrap("fsdp2", torch.bfloat16)
    with torch.no_grad():
        wrapped(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device()))
    gatherer = FSDP2FlatGatherer(wrapped, FlatOptions(engine_dtype=torch.bfloat16))
    wrapped.reshard()
    meter = MemoryMeter(device())
    meter.start()
    got = {canonical_name(n): t.detach().cpu() for n, t in gatherer.iter_full(meter)}
    reference = _full(wrapped, torch.bfloat16)
    return {"names": len(got) == len(list(wrapped.parameters())) and set(got) <= set(reference),
            "unequal": [n for n in got if n in reference and not torch.equal(got[n], reference[n])],
            "accounted": meter.accounted_peak_bytes}  # fmt: skip


def test_fsdp2_root_made_while_unsharded_is_read_from_its_shards() -> None:
    """Regression (issue 35): the root's parameters, plain while it was unsharded when the gatherer was made, were
    materialised with `full_tensor()` (an all-gather and a copy) at every sync; they are its local shards like the
    others (at world size 1 nothing is gathered and nothing is held)."""
    (out,) = run_distributed(unsharded_root, world_size=1)
    assert out["names"] and not out["unequal"], out
    assert out["accounted"] == 0, f"{out['accounted']} bytes materialised: the root's parameters were gathered"
