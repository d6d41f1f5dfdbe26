"""The Triton source of `fsdp_sync.bitsums` (the delta check's fingerprint kernel); imported only where Triton is.

Triton decides between its compiler and its interpreter (`TRITON_INTERPRET=1`) when it is imported, for its own
library as for these kernels, so this module is imported where a kernel first runs and no earlier.
"""

import triton
import triton.language as tl

from .table_triton import row_of


@triton.jit
def bit_sums_kernel(
    table, count, out, PERIOD: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr, SEARCH: tl.constexpr
):
    # `table` rows: address, words, first chunk of each tensor (3 x count int64). This program's chunk is the
    # last tensor whose first chunk is at or before it.
    program = tl.program_id(0).to(tl.int64)
    k = row_of(table + 2 * count, count, program, SEARCH)
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
