"""Persistent buffers are sent like parameters under FSDP1, FSDP2 and DDP (2 gloo ranks) and in one process:
transformers keeps some checkpoint tensors as buffers (DeepSeek-V3's router `e_score_correction_bias`), which vLLM
loads as weights. A persistent buffer comes out of the stream whole, with the value the module holds at that sync;
a non-persistent one (not a checkpoint tensor) never does; the sparse pieces of a buffer are disjoint (rank 0 holds
it all); and buffers never count as trainable (a delta sync fingerprints them instead)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import iter_full_weights
from fsdp_sync.backend import detect_backend, unwrap_outer
from fsdp_sync.config import SyncConfig
from fsdp_sync.gather import WithBuffers, make_gatherer
from tests.support.dist import run_distributed

from .models import full_reference, tiny_lm, wrap
from .pieces_check import held_mismatches

BIAS = "model.layers.1.mlp.router_bias"  # persistent, as DeepSeek-V3's gate keeps its correction bias
SCRATCH = "model.layers.1.mlp.scratch"  # non-persistent: not a checkpoint tensor


def with_buffers() -> torch.nn.Module:
    model = tiny_lm()
    mlp = model.model.layers[1].mlp
    mlp.register_buffer("router_bias", torch.arange(8, dtype=torch.float32) / 8)
    mlp.register_buffer("scratch", torch.ones(3), persistent=False)
    return model


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes: the parameters and the persistent buffers."""
    return {**full_reference(model), BIAS: model.get_buffer(BIAS).detach().clone()}


def scenario(rank: int, world_size: int, backend: str) -> dict:
    model = with_buffers()
    reference = checkpoint_tensors(model)
    wrapped = wrap(model, backend, world_size)
    # A rule (not the optimizer) updates the buffer, the same on every rank, after wrapping.
    (bias,) = [b for n, b in unwrap_outer(wrapped).named_buffers() if n.endswith("router_bias")]
    bias.add_(1.5)
    expected = {**reference, BIAS: reference[BIAS] + 1.5}
    out: dict = {"wrapper": type(wrapped).__name__}
    seen = {name: tensor.detach().to("cpu", copy=True) for name, tensor in iter_full_weights(wrapped)}
    out["names"] = sorted(seen)
    out["problems"] = [n for n, t in expected.items() if n not in seen or not torch.equal(seen[n], t)]
    gatherer = make_gatherer(wrapped, detect_backend(wrapped), SyncConfig())
    assert isinstance(gatherer, WithBuffers)
    buffer_names = [n for n in gatherer.specs() if n.endswith("router_bias")]
    out["buffer_names"] = buffer_names
    out["trainable_has_buffer"] = any(n.endswith("router_bias") for n in gatherer.trainable())
    (piece,) = gatherer.local_pieces(buffer_names)
    out["piece"] = (piece.start, piece.values.numel())
    mixed = [n for n in gatherer.specs() if n.endswith("embed_tokens.weight")] + buffer_names
    out["held"] = held_mismatches(gatherer, gatherer.held_pieces(mixed), mixed)
    out["shard_has_buffer"] = any(n.endswith("router_bias") for n, _ in gatherer.local_shards())
    return out


@pytest.mark.parametrize(("backend", "world_size"), [("fsdp1", 2), ("fsdp2", 2), ("ddp", 2), ("single", 1)])
def test_persistent_buffers_are_sent_whole_and_non_persistent_ones_never(backend: str, world_size: int) -> None:
    wrapper = {"fsdp1": "FullyShardedDataParallel", "fsdp2": "FSDPQwen2ForCausalLM", "ddp": "DistributedDataParallel"}
    expected = sorted(checkpoint_tensors(with_buffers()))
    assert BIAS in expected and SCRATCH not in expected
    for rank, r in enumerate(run_distributed(scenario, backend, world_size=world_size)):
        if backend in wrapper:
            assert r["wrapper"] == wrapper[backend]
        assert r["names"] == expected, "the persistent buffer must be sent, the non-persistent one never"
        assert r["problems"] == []
        assert len(r["buffer_names"]) == 1 and not r["trainable_has_buffer"] and r["shard_has_buffer"]
        assert r["piece"] == ((0, 8) if rank == 0 else (0, 0)), "pieces of a buffer every rank holds are disjoint"
        assert r["held"] == [], "held pieces of a parameter and a buffer must be the listed ones"
