"""TRL 1.16's built-in gather, run from TRL's own code, with its per-tensor engine call pattern.

`VLLMGeneration._iter_fsdp1_params` / `_iter_fsdp2_params` are called unchanged on the model object TRL holds (the
module inside the FSDP1 root; the FSDP2 model itself); each tensor is then pushed with its own engine call, as
`VLLMGeneration.sync_weights` does in colocate mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch

__all__ = ["trl_sync"]


def _generation_stub(model: torch.nn.Module, device: torch.device):
    from trl.generation.vllm_generation import VLLMGeneration

    # NOTE: only the attributes the two iterators read; no engine is created.
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model = model
    generation.accelerator = SimpleNamespace(device=device)
    return generation


def trl_sync(
    held_model: torch.nn.Module,
    backend: str,
    push_one: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    device: torch.device,
) -> tuple[int, int]:
    """One TRL-style sync; returns (tensors pushed, bytes pushed). Tensors go out in the trainer's dtype, as in TRL;
    the engine casts them while loading."""
    generation = _generation_stub(held_model, device)
    iterate = generation._iter_fsdp1_params if backend == "fsdp1" else generation._iter_fsdp2_params
    tensors = nbytes = 0
    for name, tensor in iterate(held_model):
        push_one([(name, tensor)])
        tensors += 1
        nbytes += tensor.numel() * tensor.element_size()
    return tensors, nbytes
