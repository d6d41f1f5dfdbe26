"""The delta check's fingerprint on a GPU in one pass: three int64 sums over a tensor's bits, for many tensors.

Why a kernel of our own: the fingerprint (`fsdp_sync.delta`) is sum(x_j), sum((j mod P) x_j) and
sum((j // P) x_j) over the tensor's bits as int64 words. In torch that is two reductions over a (rows, P) view
plus about eight small launches per tensor: at 7B shapes with LoRA on q/v the check read the 14.3 GB of skipped
weights in about 50 ms on an H200, against 3-4 ms for one read of those bytes; one Triton launch per tensor took
9-17 ms (Triton's launch from Python costs tens of microseconds, and a check watches hundreds of tensors). Here one
launch covers every tensor of a call: each program finds its tensor in a small table (address, words, first block),
reads its block of words once and adds the three products into that tensor's row of one output (int64 atomics,
which wrap exactly as torch's int64 sums do), so the values are the torch reference's, bit for bit
(`tests/unit/test_bitsums.py`), and detection is unchanged.

Triton ships with torch's CUDA builds; where it is missing, or for a tensor whose bytes are not a whole number of
int64 words, the caller falls back to the torch reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["available", "bit_sums"]

# Words per program: below the period, so a block's column index wraps at most once.
_BLOCK = 4096

# Tensors per call are found by a binary search over the call's block offsets: enough steps for 2**_SEARCH tensors.
_SEARCH = 20


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def bit_sums_kernel(table, count, out, PERIOD: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr):
        # `table` rows: address, words, first block of each tensor (3 x count int64). This program's block is the
        # last tensor whose first block is at or before it.
        program = tl.program_id(0).to(tl.int64)
        lo = program * 0
        hi = lo + count
        for _ in tl.static_range(SEARCH):
            mid = (lo + hi) // 2
            first = tl.load(table + 2 * count + mid, mask=mid < count, other=program + 1)
            at_or_before = (first <= program) & (hi - lo > 1)
            lo = tl.where(at_or_before, mid, lo)
            hi = tl.where(at_or_before | (hi - lo <= 1), hi, mid)
        k = lo
        words = tl.load(table + k).to(tl.pointer_type(tl.int64))
        n = tl.load(table + count + k)
        start = (program - tl.load(table + 2 * count + k)) * BLOCK
        index = tl.arange(0, BLOCK)
        x = tl.load(words + start + index, mask=start + index < n, other=0)
        # (j mod P, j // P) from the block's start, one wrap at most (BLOCK < P): no division per word.
        column = (start % PERIOD) + index
        wrapped = column >= PERIOD
        column = tl.where(wrapped, column - PERIOD, column)
        row = start // PERIOD + wrapped.to(tl.int64)
        tl.atomic_add(out + 3 * k, tl.sum(x, axis=0))
        tl.atomic_add(out + 3 * k + 1, tl.sum(x * column.to(tl.int64), axis=0))
        tl.atomic_add(out + 3 * k + 2, tl.sum(x * row, axis=0))

    return bit_sums_kernel


@functools.cache
def available() -> bool:
    """Whether the kernel can run here (Triton importable and a CUDA device present)."""
    if not torch.cuda.is_available():
        return False
    try:
        _kernel()
    except ImportError:
        return False
    return True


def bit_sums(words: list[torch.Tensor], period: int) -> torch.Tensor:
    """The three sums of each 1-D int64 tensor in `words` (CUDA, one device; kept alive by the caller until the
    result is read), as a (len(words), 3) int64 tensor, in one launch."""
    if period <= _BLOCK:
        raise ValueError(f"period {period} must exceed the block of {_BLOCK} words")
    if len(words) >= 2**_SEARCH:
        raise ValueError(f"{len(words)} tensors in one call; at most {2**_SEARCH - 1}")
    device = words[0].device
    out = torch.zeros(len(words), 3, dtype=torch.int64, device=device)
    firsts, blocks = [], 0
    for w in words:
        firsts.append(blocks)
        blocks += -(-w.numel() // _BLOCK)
    if not blocks:
        return out
    rows = [[w.data_ptr() for w in words], [w.numel() for w in words], firsts]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    _kernel()[(blocks,)](table, len(words), out, PERIOD=period, BLOCK=_BLOCK, SEARCH=_SEARCH)
    return out
