"""The Triton source of sparse extraction (`fsdp_sync.kernels.extract`); imported only where Triton is.

Triton decides between its compiler and its interpreter (`TRITON_INTERPRET=1`) when it is imported, for its own
library as for these kernels, so this module is imported where a kernel first runs and no earlier.

Table of a call (int64, column after column, one row per piece): the new values' address, the snapshot's address,
the element count, the piece's first chunk (chunks of CHUNK elements, numbered across every piece), and where the
piece starts in its full tensor.
"""

import triton
import triton.language as tl

from .table_triton import row_of

# How the new values are compared with the snapshot: their bits as they are (16 or 32 bits), or float32 values cast
# to bfloat16 first (round to nearest even, as torch casts).
SAME_16 = 0
SAME_32 = 1
BF16_OF_FP32 = 2


@triton.jit
def diff_kernel(
    table,
    count,
    ids,
    chunk_counts,
    chunk_base,
    piece_nan,
    cursor,
    scratch_at,
    scratch_bits,
    capacity,
    nan_bits,
    CHUNK: tl.constexpr,
    MODE: tl.constexpr,
    NAN_ABOVE: tl.constexpr,
    RESERVED: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """One chunk per program, read once: compare, count, and (where the scratch holds it) compact the changes and
    write them into the snapshot.

    The changes of a chunk go to `scratch_at` (position in the chunk) and `scratch_bits` (new bits) at a range
    reserved with one atomic on `cursor`, in chunk order within the range; ranges of different chunks come in any
    order (`compact_kernel` puts them in order). `chunk_base` keeps where the range starts, or -(start + 1) where it
    ends past `capacity`: that chunk then wrote nothing, not even the snapshot, and a second launch with RESERVED
    (over the chunks in `ids`) writes it into a scratch large enough.
    """
    program = tl.program_id(0).to(tl.int64)
    if RESERVED:
        chunk = tl.load(ids + program)
    else:
        chunk = program
    k = row_of(table + 3 * count, count, chunk, SEARCH)
    n = tl.load(table + 2 * count + k)
    local = (chunk - tl.load(table + 3 * count + k)) * CHUNK
    offsets = local + tl.arange(0, CHUNK)
    inside = offsets < n
    if MODE == 1:
        snapshot = tl.load(table + count + k).to(tl.pointer_type(tl.int32))
        old = tl.load(snapshot + offsets, mask=inside, other=0)
        new = tl.load(tl.load(table + k).to(tl.pointer_type(tl.int32)) + offsets, mask=inside, other=0)
        nan = (new & 0x7FFFFFFF) > NAN_ABOVE
    else:
        snapshot = tl.load(table + count + k).to(tl.pointer_type(tl.int16))
        old = tl.load(snapshot + offsets, mask=inside, other=0).to(tl.int32) & 0xFFFF
        if MODE == 2:
            x = tl.load(tl.load(table + k).to(tl.pointer_type(tl.int32)) + offsets, mask=inside, other=0)
            u = x.to(tl.uint32, bitcast=True)
            nan = (u & 0x7FFFFFFF) > 0x7F800000
            # Round to nearest even on the bits (what torch's cast does for every value but NaN): exact for signed
            # zeros, subnormals, infinities and overflow to infinity, on the compiler and the interpreter alike.
            rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
            new = tl.where(nan, nan_bits, rounded)
        else:
            new = tl.load(tl.load(table + k).to(tl.pointer_type(tl.int16)) + offsets, mask=inside, other=0)
            new = new.to(tl.int32) & 0xFFFF
            nan = (new & 0x7FFF) > NAN_ABOVE
    changed = (new != old) & inside
    flags = changed.to(tl.int32)
    c = tl.sum(flags, axis=0)
    if RESERVED:
        base = -tl.load(chunk_base + chunk) - 1
    else:
        tl.store(chunk_counts + chunk, c)
        # A NaN among the changes: vLLM's patch loader reads NaN as "unchanged", so the tensor goes whole.
        if tl.max((nan & changed).to(tl.int32), axis=0) > 0:
            tl.atomic_max(piece_nan + k, 1)
        base = c.to(tl.int64) * 0
        if c > 0:
            base = tl.atomic_add(cursor, c.to(tl.int64))
    if base + c <= capacity:
        at = base + tl.cumsum(flags, axis=0) - 1
        tl.store(scratch_at + at, (offsets - local).to(tl.int32), mask=changed)
        if MODE == 1:
            tl.store(scratch_bits + at, new, mask=changed)
            tl.store(snapshot + offsets, new, mask=changed)
        else:
            tl.store(scratch_bits + at, new.to(tl.int16), mask=changed)
            tl.store(snapshot + offsets, new.to(tl.int16), mask=changed)
        tl.store(chunk_base + chunk, base)
    else:
        tl.store(chunk_base + chunk, -base - 1)


@triton.jit
def compact_kernel(
    table,
    count,
    chunk_counts,
    chunk_base,
    chunk_end,
    scratch_at,
    scratch_bits,
    out_index,
    out_bits,
    CHUNK: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """One chunk per program: its changes from the scratch to their place in chunk order (`chunk_end`: the inclusive
    prefix sum of `chunk_counts`), as indices into the full tensor and new bits."""
    chunk = tl.program_id(0).to(tl.int64)
    c = tl.load(chunk_counts + chunk).to(tl.int64)
    if c > 0:
        k = row_of(table + 3 * count, count, chunk, SEARCH)
        first = (chunk - tl.load(table + 3 * count + k)) * CHUNK + tl.load(table + 4 * count + k)
        base = tl.load(chunk_base + chunk)
        to = tl.load(chunk_end + chunk) - c
        j = tl.arange(0, CHUNK)
        some = j < c
        at = tl.load(scratch_at + base + j, mask=some, other=0)
        bits = tl.load(scratch_bits + base + j, mask=some, other=0)
        tl.store(out_index + to + j, first + at.to(tl.int64), mask=some)
        tl.store(out_bits + to + j, bits, mask=some)
