"""The delta check's fingerprint on a GPU in one pass: three int64 sums over a tensor's bits, for many tensors.

Why a kernel of our own: the fingerprint (`fsdp_sync.delta`) is sum(x_j), sum((j mod P) x_j) and
sum((j // P) x_j) over the tensor's bits as int64 words. In torch that is two reductions over a (rows, P) view
plus about eight small launches per tensor: at 7B shapes with LoRA on q/v the check read the 14.3 GB of skipped
weights in about 50 ms on an H200, against 3-4 ms for one read of those bytes; one Triton launch per tensor took
9-17 ms (Triton's launch from Python costs tens of microseconds, and a check watches hundreds of tensors). Here one
launch covers every tensor of a call: each program finds its tensor in a small table (address, words, first chunk),
reads its chunk of words once and adds the three sums into that tensor's row of one output (int64 atomics,
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


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def bit_sums_kernel(
        table, count, out, PERIOD: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr, SEARCH: tl.constexpr
    ):
        # `table` rows: address, words, first chunk of each tensor (3 x count int64). This program's chunk is the
        # last tensor whose first chunk is at or before it.
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
        chunk = (program - tl.load(table + 2 * count + k)) * (BLOCK * STEPS)
        index = tl.arange(0, BLOCK)
        # Per word only adds and one select: with c and r the step's (start mod P, start // P) and w whether a word's
        # column wrapped, sum(x (c + i - P w)) = c sum(x) + sum_i i (sum over steps of x_i) - P sum(x w), and
        # sum(x (r + w)) = r sum(x) + sum(x w). int64 arithmetic wraps, so the regrouping is exact.
        per_index = tl.zeros([BLOCK], dtype=tl.int64)
        by_column = tl.sum(per_index, axis=0)
        by_row = by_column
        for step in tl.static_range(STEPS):
            start = chunk + step * BLOCK
            x = tl.load(words + start + index, mask=start + index < n, other=0)
            c = start % PERIOD
            in_wrap = tl.where(index >= PERIOD - c, x, 0)  # one wrap at most: BLOCK < P
            per_index += x
            step_sum = tl.sum(x, axis=0)
            wrap_sum = tl.sum(in_wrap, axis=0)
            by_column += c * step_sum - PERIOD * wrap_sum
            by_row += (start // PERIOD) * step_sum + wrap_sum
        by_column += tl.sum(per_index * index.to(tl.int64), axis=0)
        tl.atomic_add(out + 3 * k, tl.sum(per_index, axis=0))
        tl.atomic_add(out + 3 * k + 1, by_column)
        tl.atomic_add(out + 3 * k + 2, by_row)

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
    chunk = _BLOCK * _STEPS
    device = words[0].device
    out = torch.zeros(len(words), 3, dtype=torch.int64, device=device)
    firsts, chunks = [], 0
    for w in words:
        firsts.append(chunks)
        chunks += -(-w.numel() // chunk)
    if not chunks:
        return out
    rows = [[w.data_ptr() for w in words], [w.numel() for w in words], firsts]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    # NOTE: the search's steps as a constant (one compile per power of two of tensors), not the most a call allows:
    # each step is a dependent load, paid by every program.
    search = max(1, len(words).bit_length())
    _kernel()[(chunks,)](table, len(words), out, PERIOD=period, BLOCK=_BLOCK, STEPS=_STEPS, SEARCH=search,
                         num_warps=_WARPS)  # fmt: skip
    return out
