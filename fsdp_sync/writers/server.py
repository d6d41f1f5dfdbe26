"""Server writer: weights go to a separate `vllm serve` process through TRL's client (vLLM's native NCCL transfer).

Only the main process pushes; every other rank still gathers (the collectives need it) and drains the stream.
The tensors are announced first (names, dtypes, shapes in stream order), as vLLM's weight-transfer protocol requires,
so the metadata comes from the sync plan, not from a first gather pass as in TRL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor

__all__ = ["ServerWriter"]


class ServerWriter:
    """Push through `trl.generation.vllm_client.VLLMClient.update_named_params`.

    Args:
        client: the TRL client (main process), or None on the other ranks.
        checkpoint_dir: the checkpoint the server was started from (the trainer's model path by default).
        engine_dtype: dtype to send floating tensors in (None: the trainer's dtype, as TRL does).
    """

    kind = "server:trl-client"
    retains_tensors = True  # vLLM's packed broadcast concatenates a chunk of tensors before sending it

    def __init__(self, client: Any, *, checkpoint_dir: str, engine_dtype: torch.dtype | None = None) -> None:
        self.client = client
        self.pushes = client is not None
        self.checkpoint_dir = checkpoint_dir
        self.engine_dtype = engine_dtype
        self._planned: Sequence[PlannedTensor] = ()

    def manifest(self) -> EngineManifest:
        return read_checkpoint_manifest(self.checkpoint_dir, engine_dtype=self.engine_dtype)

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Record the stream order; called once per plan."""
        self._planned = planned

    def _metadata(self) -> list[tuple[str, str, list[int]]]:
        def dtype_name(spec_dtype: torch.dtype) -> str:
            dtype = self.engine_dtype if (self.engine_dtype is not None and spec_dtype.is_floating_point) else spec_dtype
            return str(dtype).removeprefix("torch.")

        return [(t.name, dtype_name(t.spec.dtype), list(t.spec.shape)) for t in self._planned]

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.client.update_named_params(self._metadata(), iter(weights))

    def finish(self) -> None:
        self.client.reset_prefix_cache()
