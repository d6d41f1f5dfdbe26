"""TRL's own async-trainer sync on a CPU machine: its `WeightTransferClient` with gloo in place of NCCL.

Why: TRL 1.16's `AsyncGRPOTrainer` sends through vLLM's NCCL engine (`weight_transfer.WeightTransferClient`), which
needs CUDA on both ends. To record what the stock trainer sends and what the server then holds (tests, the
benchmark's TRL row), this stand-in does what that client does, in the same order, over this package's gloo transport:
the manifest from TRL's own `_iter_vllm_named_params` on the model before it is wrapped (TRL builds it in its
constructor), `pause` (`/pause?mode=keep`), `send_weights(iterator)` = start, announce the manifest, broadcast the
stream TRL hands it (`_streaming_iter`, unchanged), finish; `resume`. The stream is checked against the manifest as
it goes (the NCCL client would instead receive into buffers sized from the manifest), so a stream that disagrees
with it (FSDP1's flat shards) fails with its names. Test-side only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["GlooStandIn"]


class GlooStandIn:
    """TRL's `WeightTransferProtocol`, as its NCCL `WeightTransferClient` behaves, over gloo (main process only).

    Args:
        base_url: the vLLM server (started with the gloo weight-transfer backend).
        group_port: the port this trainer hosts the transfer group on.
    """

    def __init__(self, base_url: str, group_port: int) -> None:
        from fsdp_sync.server_client import ServerClient

        self.client = ServerClient(base_url, timeout=300.0)
        self.group_port = group_port
        self.manifest: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.engine: Any = None
        self.pauses: list[float] = []
        self._paused_at: float | None = None

    def describe(self, model: torch.nn.Module) -> None:
        """The manifest TRL builds in its constructor, from the model before it is wrapped."""
        from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

        self.manifest = [(n, p.dtype, tuple(p.shape)) for n, p in _iter_vllm_named_params(model)]

    def init_weight_transfer(self) -> None:
        from fsdp_sync.compat.weight_transfer import plan_source
        from fsdp_sync.transfer.gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
        from fsdp_sync.writers.server import local_address_towards

        source = plan_source(self.manifest)
        info = GlooTrainerInitInfo(
            master_address=local_address_towards(self.client.base_url),
            master_port=self.group_port,
            world_size=1 + self.client.world_size(),
            rank=0,
        )
        self.engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=self.client, source=source)

    def pause(self) -> None:
        import time

        self.client.pause()
        self._paused_at = time.perf_counter()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.source.feed(iterator)
        self.engine.send_weights()

    def resume(self) -> None:
        import time

        self.client.resume()
        if self._paused_at is not None:
            self.pauses.append(time.perf_counter() - self._paused_at)
            self._paused_at = None

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
