"""`benchmarks.copies.CopyPlan`: the GPU benchmark's engine stand-in fills its buffers the same way whichever copy
mode it uses (per tensor, batched, graph replay), bit for bit, casts included; a graph is replayed only where every
address is the one it was captured with.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.buffers import FusedBuffersWriter
from benchmarks.copies import CopyPlan
from fsdp_sync.compat.manifest import TensorSpec

SPECS = {
    "model.layers.0.self_attn.q_proj.weight": TensorSpec((8, 4), torch.float32),
    "model.layers.0.self_attn.k_proj.weight": TensorSpec((2, 4), torch.float32),
    "model.layers.0.self_attn.v_proj.weight": TensorSpec((2, 4), torch.float32),
    "model.layers.0.mlp.gate_proj.weight": TensorSpec((6, 4), torch.float32),
    "model.layers.0.mlp.up_proj.weight": TensorSpec((6, 4), torch.float32),
    "model.norm.weight": TensorSpec((4,), torch.float32),
}


def _weights(device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The stream: float32 tensors (cast on the way) and bfloat16 ones (copied as they are)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for k, (name, spec) in enumerate(SPECS.items()):
        tensor = torch.randn(spec.shape, generator=generator)
        out.append((name, (tensor if k % 2 else tensor.to(torch.bfloat16)).to(device)))
    return out


@pytest.mark.parametrize("mode", ["batched", "graph"])
@pytest.mark.parametrize("flush_bytes", [1, 2**30])
def test_every_mode_fills_the_buffers_as_the_per_tensor_loop(mode: str, flush_bytes: int) -> None:
    loop = FusedBuffersWriter(SPECS, dtype=torch.bfloat16, device=torch.device("cpu"))
    other = loop.copying(mode)
    other.copies.flush_bytes = flush_bytes
    assert other.slots is loop.slots and other.retains_tensors and not loop.retains_tensors
    for seed in range(3):
        weights = _weights(torch.device("cpu"), seed)
        loop.write(iter(weights))
        expected = {n: b.clone() for n, b in loop.buffers.items()}
        for buffer in loop.buffers.values():
            buffer.fill_(float("nan"))
        other.write(iter(weights))
        for name, buffer in loop.buffers.items():
            assert torch.equal(buffer.view(torch.int16), expected[name].view(torch.int16)), name
    assert other.mismatches(dict(weights)) == []


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="copy mode 'fast'; valid: loop, batched, graph"):
        CopyPlan({}, mode="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_the_graph_is_replayed_only_while_every_address_repeats() -> None:
    device = torch.device("cuda")
    plan = FusedBuffersWriter(SPECS, dtype=torch.bfloat16, device=device, copies="graph")
    weights = _weights(device, 0)
    for _ in range(2):  # two syncs of the same program: captured after the second
        plan.write(iter(weights))
    assert plan.copies.replays == 0
    for k, (_, tensor) in enumerate(weights):
        tensor.copy_(torch.full_like(tensor, float(k)))
    plan.write(iter(weights))  # the same addresses: replayed, with the values the sources hold now
    torch.cuda.synchronize()
    assert plan.copies.replays == 1 and plan.mismatches(dict(weights)) == []
    moved = [(n, t.clone()) for n, t in weights]  # new addresses: copied eagerly
    plan.write(iter(moved))
    torch.cuda.synchronize()
    assert plan.copies.replays == 1 and plan.mismatches(dict(moved)) == []
