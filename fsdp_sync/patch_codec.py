"""The patch codec (bottom floor): a patch's indices and values as the bytes that travel, and back.

Why its own module at the bottom: the trainer's patch collectives (`fsdp_sync.sync.patches`) and both ends of the
gloo backend's patch round (`fsdp_sync.transfer.gloo`, which also runs inside a vLLM server) encode and decode the
same way; neither end may import the other's floor.

Indices travel as their low 16 bits, grouped by block of 2**16 elements with a count per block (`encode_indices`,
`decode_indices`): 2 bytes per change plus 4 per block and rank, instead of 8.
"""

from __future__ import annotations

import math

import torch

from fsdp_sync.compat.patch_api import EnginePatch

__all__ = ["decode_indices", "decode_patch", "encode_indices", "encode_patch", "index_blocks", "segment_sizes"]

# Indices travel as their low 16 bits, grouped by block of 2**16 elements, with a count per block: 2 bytes per change
# plus 4 per block per rank, instead of 4 or 8 per change (measured at learning rate 1e-6: about 2% of bf16 values
# change per step, so a change costs 4 bytes with its value instead of 6, and a patch is about 23x smaller than the
# dense tensor instead of 16x; `benchmarks/sparse.py`).
_BLOCK_BITS = 16


def index_blocks(numel: int) -> int:
    """The blocks of 2**16 elements of a tensor of `numel` elements."""
    return -(-numel // (1 << _BLOCK_BITS))


def segment_sizes(numel: int, count: int, itemsize: int) -> tuple[int, int, int]:
    """The bytes of one encoded patch's segments (`encode_patch`): its blocks, indices and values."""
    return 4 * index_blocks(numel), 2 * count, itemsize * count


def encode_indices(indices: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the low 16 bits of each ascending index, as int16; the changes per block, int32)."""
    low = (indices & 0xFFFF).to(torch.int32)
    low16 = torch.where(low >= 1 << 15, low - (1 << 16), low).to(torch.int16)
    per_block = torch.bincount(indices >> _BLOCK_BITS, minlength=index_blocks(numel)).to(torch.int32)
    return low16, per_block


def decode_indices(low16: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """The ascending int64 indices `encode_indices` wrote."""
    low = low16.to(torch.int64) & 0xFFFF
    block = torch.repeat_interleave(torch.arange(per_block.numel(), device=low.device), per_block.to(torch.int64))
    return (block << _BLOCK_BITS) | low


def encode_patch(patch: EnginePatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One patch as the bytes of its three segments, on the host: its changes per block (int32), the low 16 bits of
    each changed index (int16), and the new values (in the patch's dtype). The gloo backend's patch round sends these;
    `decode_patch` reads them back."""
    low16, per_block = encode_indices(patch.indices, math.prod(patch.shape))
    values = patch.values.to(patch.dtype)
    return tuple(t.contiguous().view(torch.uint8).cpu() for t in (per_block, low16, values))  # type: ignore[return-value]


def decode_patch(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, blocks: torch.Tensor, low16: torch.Tensor, values: torch.Tensor
) -> EnginePatch:
    """The patch `encode_patch` wrote, from its three segments' bytes."""
    indices = decode_indices(low16.view(torch.int16), blocks.view(torch.int32))
    return EnginePatch(name, shape, dtype, indices, values.view(dtype))
