"""An engine stand-in for machines without vLLM: preallocated weight buffers in vLLM's fused layout.

vLLM stores `q_proj`, `k_proj`, `v_proj` as row blocks of one `qkv_proj` tensor and `gate_proj`, `up_proj` as row
blocks of `gate_up_proj`; its loaders copy each checkpoint tensor into its block (casting to the engine dtype).
This writer does that copy, so a sync into it moves the bytes a sync into a GPU engine moves, without vLLM: one
`copy_` per tensor as vLLM's loaders (`copies="loop"`), or batched as an engine that takes its weights in place could
(`"batched"`, `"graph"`: `copies.CopyPlan`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch

from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor, TensorSpec

from .copies import CopyPlan

__all__ = ["FusedBuffersWriter", "VLLM_PACKED"]

# vLLM's `packed_modules_mapping` for Llama/Qwen2-family models.
VLLM_PACKED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _fused_name(name: str) -> tuple[str, int]:
    """(engine name, index of this part in its fused tensor) for a checkpoint name."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    for fused, parts in VLLM_PACKED.items():
        if last in parts:
            return f"{parent}.{fused}.{leaf}", parts.index(last)
    return name, 0


class FusedBuffersWriter:
    """Writer into engine-layout buffers: each tensor into its block, cast to `dtype` (`copies`: how; `CopyPlan`)."""

    kind = "buffers:vllm-fused-layout"
    pushes = True
    engine_per_rank = True

    def __init__(
        self,
        specs: dict[str, TensorSpec],
        *,
        dtype: torch.dtype,
        device: torch.device,
        copies: str = "loop",
    ) -> None:
        self.specs = specs
        self.engine_dtype = dtype
        parts: dict[str, list[tuple[int, str, TensorSpec]]] = {}
        for name, spec in specs.items():
            fused, index = _fused_name(name)
            parts.setdefault(fused, []).append((index, name, spec))
        self.buffers: dict[str, torch.Tensor] = {}
        self.slots: dict[str, torch.Tensor] = {}
        for fused, items in parts.items():
            items.sort()
            rows = sum(spec.shape[0] for _, _, spec in items)
            shape = (rows, *items[0][2].shape[1:])
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.buffers[fused] = buffer
            offset = 0
            for _, name, spec in items:
                self.slots[name] = buffer.narrow(0, offset, spec.shape[0])
                offset += spec.shape[0]
        self.copies = CopyPlan(self.slots, mode=copies)

    def copying(self, copies: str) -> FusedBuffersWriter:
        """A writer into these same buffers that copies another way (methods side by side on one engine)."""
        other = copy.copy(self)
        other.copies = CopyPlan(self.slots, mode=copies)
        return other

    @property
    def retains_tensors(self) -> bool:
        """Whether tensors are held past the next one (batched copies): the sync then copies those a gatherer frees."""
        return self.copies.mode != "loop"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def manifest(self) -> EngineManifest:
        return EngineManifest(tensors=self.specs, engine_dtype=self.engine_dtype, source="engine-layout buffers")

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """Nothing to announce."""

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.copies.copy(weights)

    def engine_layout(self):  # type: ignore[no-untyped-def]
        from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming

        return EngineLayout(EngineNaming(VLLM_PACKED), frozenset(name.rpartition(".")[0] for name in self.buffers))

    def finish(self) -> None:
        """No cache to reset."""

    def destination(self, name: str) -> torch.Tensor:
        """The block a checkpoint tensor lands in (for strategies that gather straight into the engine)."""
        return self.slots[name]

    def mismatches(self, expected: dict[str, torch.Tensor]) -> list[str]:
        """Checkpoint names whose block differs from `expected` (cast to the engine dtype) in any bit."""
        return [n for n, t in expected.items() if not torch.equal(self.slots[n], t.to(self.engine_dtype))]
