"""CPU-offloaded FSDP shards on a GPU machine: every strategy moves them to the compute device and gathers exactly.

Runs where CUDA is available (one process per GPU, NCCL); skipped on CPU-only machines (CI). Offloaded shards live
in host memory while NCCL gathers only device tensors: the gatherers move them with `compute_device` first.
"""

from __future__ import annotations

import pytest
import torch

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_sync.compat.names import canonical_name
from fsdp_sync.backend import detect_backend
from fsdp_sync.config import SyncConfig
from fsdp_sync.gather import make_gatherer
from fsdp_sync.memory import MemoryMeter
from tests.support.dist import run_distributed

from .models import decoder_layer_cls, full_reference, tiny_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL cannot gather host tensors)")


def offload_scenario(rank: int, world_size: int, backend: str, strategy: str) -> dict[str, object]:
    device = torch.device("cuda", torch.cuda.current_device())
    model = tiny_lm(vocab=257).to("cpu")  # offloaded parameters start in host memory
    reference = full_reference(model)
    if backend == "fsdp1":
        from torch.distributed.fsdp import CPUOffload
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({decoder_layer_cls(model)}),
            device_id=device,
            cpu_offload=CPUOffload(offload_params=True),
            use_orig_params=True,
        )
        config = SyncConfig(fsdp1_strategy=strategy)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cuda", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
        wrapped = fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())  # parameters stay on CPU
        for module in model.modules():  # buffers (rotary frequencies) are not offloaded: they live on the device
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        config = SyncConfig(fsdp2_strategy=strategy)
    gatherer = make_gatherer(
        wrapped, detect_backend(wrapped), config, engine_dtype=torch.bfloat16, compute_device=device
    )
    got = {canonical_name(n): t.to("cpu", torch.bfloat16) for n, t in gatherer.iter_full(MemoryMeter(device))}
    ok_before = {n: torch.equal(got[n], reference[n].to(torch.bfloat16)) for n in reference}
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ids = torch.randint(0, 257, (2, 8), device=device)
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    trained = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    after = {canonical_name(n): t.to("cpu", torch.bfloat16) for n, t in gatherer.iter_full(MemoryMeter(device))}
    ok_after = {n: torch.equal(after[n], trained[n].to("cpu", torch.bfloat16)) for n in after}
    return {"names": sorted(got) == sorted(reference), "before": ok_before, "after": ok_after}


@pytest.mark.parametrize(
    "backend,strategy",
    [("fsdp1", "flat"), ("fsdp1", "unit"), ("fsdp2", "flat"), ("fsdp2", "unit"), ("fsdp2", "param")],
)
def test_offloaded_shards_gather_exactly(backend: str, strategy: str) -> None:
    world = torch.cuda.device_count()
    for r in run_distributed(offload_scenario, backend, strategy, world_size=world, backend="nccl"):
        assert r["names"]
        assert all(r["before"].values()), [n for n, ok in r["before"].items() if not ok]
        assert all(r["after"].values()), [n for n, ok in r["after"].items() if not ok]
