"""Triton helpers shared by the kernels' sources (`sums_triton`, `extract_triton`); imported only where Triton is."""

import triton
import triton.language as tl


@triton.jit
def row_of(firsts, count, chunk, SEARCH: tl.constexpr):
    """The last of `count` table rows whose first chunk (`firsts`: ascending, one per row) is at or before `chunk`:
    the tensor a program's chunk belongs to, in SEARCH dependent loads (a binary search; SEARCH >= log2(count))."""
    lo = chunk * 0
    hi = lo + count
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        first = tl.load(firsts + mid, mask=mid < count, other=chunk + 1)
        at_or_before = (first <= chunk) & (hi - lo > 1)
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before | (hi - lo <= 1), hi, mid)
    return lo
