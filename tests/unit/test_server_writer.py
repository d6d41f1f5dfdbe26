"""`ServerWriter` (server mode through TRL's client): metadata announced in stream order, engine dtype, main rank only.

TRL's `VLLMClient.update_named_params(metadata, iterator)` announces every tensor before broadcasting them in the
same order; the transport itself (vLLM's NCCL weight transfer) needs CUDA and a server, so a recording fake stands in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from fsdp_sync.compat.manifest import TensorSpec
from fsdp_sync.compat.names import NameRules
from fsdp_sync.pipeline import WeightSync
from fsdp_sync.writers import ServerWriter


class RecordingClient:
    """Records what TRL's client would send."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, str, list[int]]] = []
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.resets = 0

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]], named: Iterator) -> None:
        self.metadata = metadata
        self.sent = [(n, t.clone()) for n, t in named]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


class TwoTensorGatherer:
    """Yields a float and an integer tensor under wrapper names, in a fixed order."""

    strategy = "fake"
    tensors_outlive_step = True

    def __init__(self) -> None:
        self.values = {
            "_fsdp_wrapped_module.b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "_fsdp_wrapped_module.a.index": torch.arange(4, dtype=torch.int64),
        }

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.values.items()}

    def iter_full(self, meter: object) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.values.items()


def _checkpoint(tmp_path: Path) -> Path:
    save_file({"b.weight": torch.zeros(2, 3, dtype=torch.bfloat16), "a.index": torch.zeros(4, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def test_metadata_in_stream_order_with_engine_dtype(tmp_path: Path) -> None:
    """The announced (name, dtype, shape) list matches what is then sent, in order; floats in the engine dtype."""
    client = RecordingClient()
    writer = ServerWriter(client, checkpoint_dir=str(_checkpoint(tmp_path)), engine_dtype=torch.bfloat16)
    report = WeightSync(TwoTensorGatherer(), writer, rules=NameRules()).sync()
    assert client.metadata == [("b.weight", "bfloat16", [2, 3]), ("a.index", "int64", [4])]
    assert [n for n, _ in client.sent] == ["b.weight", "a.index"]
    assert client.sent[0][1].dtype == torch.bfloat16 and client.sent[1][1].dtype == torch.int64
    assert torch.equal(client.sent[0][1], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    assert client.resets == 1
    assert report.tensors == 2 and report.writer == "server:trl-client"


def test_other_ranks_gather_without_pushing(tmp_path: Path) -> None:
    """Without a client (ranks other than the main one) the stream is drained and nothing is announced."""
    gatherer = TwoTensorGatherer()
    consumed: list[str] = []
    original = gatherer.iter_full

    def counting(meter: object) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in original(meter):
            consumed.append(name)
            yield name, tensor

    gatherer.iter_full = counting  # type: ignore[method-assign]
    writer = ServerWriter(None, checkpoint_dir=str(_checkpoint(tmp_path)))
    assert writer.pushes is False
    WeightSync(gatherer, writer, rules=NameRules()).sync()
    assert consumed == list(gatherer.values), "every rank must run the whole gather (it holds collectives)"
