"""The delta check's fingerprint on a GPU in one pass: three int64 sums over a tensor's bits, for many tensors.

Why a kernel of our own: the fingerprint (`fsdp_sync.sync.fingerprint`) is sum(x_j), sum((j mod P) x_j) and
sum((j // P) x_j) over the tensor's bits as int64 words. In torch that is two reductions over a (rows, P) view
plus about eight small launches per tensor: at 7B shapes with LoRA on q/v the check read the 14.3 GB of skipped
weights in about 50 ms on an H200, against 3-4 ms for one read of those bytes; one Triton launch per tensor took
9-17 ms (Triton's launch from Python costs tens of microseconds, and a check watches hundreds of tensors). Here one
launch covers every tensor of a call: each program finds its tensor in a small table (address, words, first chunk),
reads its chunk of words once and adds the three sums into that tensor's row of one output (int64 atomics,
which wrap exactly as torch's int64 sums do), so the values are the torch reference's, bit for bit
(`tests/unit/test_bitsums.py`), and detection is unchanged.

The table of addresses, sizes and first chunks is kept between calls (`fsdp_sync.kernels.runtime.PointerTable`):
the shards a check reads do not move between syncs, so a call costs the kernel, not a table built and copied per
tensor. Triton ships with torch's CUDA builds; where it is missing, or for a tensor whose bytes are not whole,
aligned int64 words (`words`), the caller falls back to the torch reference. Under Triton's interpreter
(`TRITON_INTERPRET=1`) the same kernel runs on CPU tensors: the unit tests compare it with the reference there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kernels.runtime import PointerTable

__all__ = ["BitSums", "words"]

# Words per step (below the period, so a step's column index wraps at most once), steps per program and warps per
# program: each program reads STEPS x BLOCK words (64 KiB) of one tensor and adds its three sums with three atomics.
# NOTE: measured on the H200 (13.4 GB in 100 tensors, a sweep of block 512-2048, steps 4-32, warps 1-16): with two
# int64 multiplies per word (emulated on the GPU) the kernel read 1.2-1.4 TB/s whatever the shape; regrouped so that
# a word costs adds only, 2.2-2.35 TB/s at 1024 x 8 words on 4 warps (more warps or longer programs were slower).
_BLOCK = 1024
_STEPS = 8
_WARPS = 4

# Tensors per call are found by a binary search over the call's chunk offsets: at most 2**_SEARCH tensors.
_SEARCH = 20


def words(tensor: torch.Tensor) -> int | None:
    """How many int64 words the kernel reads for `tensor`: its bytes where they are contiguous, a whole number of
    words, and start on a word boundary; else None (the caller takes the torch reference)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes % 8 or tensor.data_ptr() % 8 or not tensor.is_contiguous():
        return None
    return nbytes // 8


class BitSums:
    """The three sums of many tensors' bits in one launch, for one period; the launch's table is kept between calls.

    Args:
        period: P in the sums (more than the kernel's block of words, so a step's column index wraps at most once).
    """

    def __init__(self, period: int) -> None:
        if period <= _BLOCK:
            raise ValueError(f"period {period} must exceed the block of {_BLOCK} words")
        self.period = period
        self._table = PointerTable()

    def __call__(self, addresses: Sequence[int], sizes: Sequence[int], device: torch.device) -> torch.Tensor:
        """The sums of the int64 words at each address (`sizes` words each, on `device`; the caller keeps the
        memory alive until the result is read), as a fresh (len(addresses), 3) int64 tensor on `device`."""
        count = len(addresses)
        if count >= 2**_SEARCH:
            raise ValueError(f"{count} tensors in one call; at most {2**_SEARCH - 1}")
        out = torch.zeros(count, 3, dtype=torch.int64, device=device)
        chunk = _BLOCK * _STEPS
        firsts, chunks = [], 0
        for size in sizes:
            firsts.append(chunks)
            chunks += -(-size // chunk)
        if not chunks:
            return out
        table = self._table.get((addresses, sizes, firsts), device)
        # NOTE: the search's steps as a constant (one compile per power of two of tensors), not the most a call
        # allows: each step is a dependent load, paid by every program.
        search = max(1, count.bit_length())
        from .kernels.sums_triton import bit_sums_kernel

        bit_sums_kernel[(chunks,)](table, count, out, PERIOD=self.period, BLOCK=_BLOCK, STEPS=_STEPS, SEARCH=search,
                                   num_warps=_WARPS)  # fmt: skip
        return out
