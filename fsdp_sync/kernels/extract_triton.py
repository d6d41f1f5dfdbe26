"""The Triton source of sparse extraction (`fsdp_sync.kernels.extract`); imported only where Triton is.

Triton decides between its compiler and its interpreter (`TRITON_INTERPRET=1`) when it is imported, for its own
library as for these kernels, so this module is imported where a kernel first runs and no earlier.

Table of a call (int64, column after column, one row per piece): the new values' address, the snapshot's address,
the element count, the piece's first chunk (chunks of CHUNK elements, numbered across every piece), where the piece
starts in its full tensor, and whether both addresses are 16-byte aligned (1) or not (0). Beside it, `chunk_row`
(int32, one per chunk): the row its chunk belongs to.
"""

import triton
import triton.language as tl

# How the new values are compared with the snapshot: their bits as they are (16 or 32 bits), or float32 values cast
# to bfloat16 first (round to nearest even, as torch casts).
SAME_16 = 0
SAME_32 = 1
BF16_OF_FP32 = 2


@triton.jit
def _read(table, count, k, offsets, inside, nan_bits, MODE: tl.constexpr, NAN_ABOVE: tl.constexpr,
          WHOLE: tl.constexpr):
    """A chunk's snapshot address, old and new bits (as int32; 16-bit ones zero-extended) and where the new value is
    NaN. WHOLE: every offset is inside the piece and both addresses are 16-byte aligned (no mask, aligned loads)."""
    if MODE == 1:
        snapshot = tl.load(table + count + k).to(tl.pointer_type(tl.int32))
        source = tl.load(table + k).to(tl.pointer_type(tl.int32))
    elif MODE == 2:
        snapshot = tl.load(table + count + k).to(tl.pointer_type(tl.int16))
        source = tl.load(table + k).to(tl.pointer_type(tl.int32))
    else:
        snapshot = tl.load(table + count + k).to(tl.pointer_type(tl.int16))
        source = tl.load(table + k).to(tl.pointer_type(tl.int16))
    if WHOLE:
        snapshot = tl.multiple_of(snapshot, 16)
        source = tl.multiple_of(source, 16)
        old = tl.load(snapshot + offsets)
        x = tl.load(source + offsets)
    else:
        old = tl.load(snapshot + offsets, mask=inside, other=0)
        x = tl.load(source + offsets, mask=inside, other=0)
    if MODE == 1:
        new = x
        nan = (new & 0x7FFFFFFF) > NAN_ABOVE
    elif MODE == 2:
        old = old.to(tl.int32) & 0xFFFF
        u = x.to(tl.uint32, bitcast=True)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        # Round to nearest even on the bits (what torch's cast does for every value but NaN): exact for signed zeros,
        # subnormals, infinities and overflow to infinity, on the compiler and the interpreter alike.
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        new = tl.where(nan, nan_bits, rounded)
    else:
        old = old.to(tl.int32) & 0xFFFF
        new = x.to(tl.int32) & 0xFFFF
        nan = (new & 0x7FFF) > NAN_ABOVE
    return snapshot, old, new, nan


@triton.jit
def diff_kernel(
    table,
    count,
    chunk_row,
    ids,
    chunk_counts,
    chunk_base,
    chunk_first,
    piece_nan,
    cursor,
    scratch_offset,
    scratch_bits,
    slots,
    limit,
    nan_bits,
    CHUNK: tl.constexpr,
    SLOT: tl.constexpr,
    MODE: tl.constexpr,
    NAN_ABOVE: tl.constexpr,
    RESERVED: tl.constexpr,
):
    """One chunk per program, read once: compare, count, and (where the scratch holds it) compact the changes and
    write them into the snapshot.

    The changes of a chunk go to `scratch_offset` (their place in the chunk) and `scratch_bits` (new bits), in order:
    into the chunk's own slot of SLOT entries (at chunk x SLOT) where they fit, else into a range of the overflow
    region (from `slots` on) reserved with one atomic on `cursor`. `chunk_first` keeps the full-tensor index of the
    chunk's first element and `chunk_base` where its changes start, or -(start + 1) where they would end past
    `limit`: that chunk then wrote nothing, not even the snapshot, and a second launch with RESERVED (over the
    chunks in `ids`) writes it into a scratch large enough.

    NOTE: a slot of its own per chunk, not a range reserved on one counter for every chunk: the atomic's round trip
    to memory sat between each program's loads and its stores, and every program waited on the same address. Only a
    chunk with more than SLOT changes takes it. The row of a chunk is one load (`chunk_row`).
    """
    program = tl.program_id(0).to(tl.int64)
    if RESERVED:
        chunk = tl.load(ids + program)
    else:
        chunk = program
    k = tl.load(chunk_row + chunk).to(tl.int64)
    n = tl.load(table + 2 * count + k)
    local = (chunk - tl.load(table + 3 * count + k)) * CHUNK
    offsets = local + tl.arange(0, CHUNK)
    inside = offsets < n
    # NOTE: a whole chunk of a piece whose two addresses are 16-byte aligned (column 5) is read without a mask and
    # with the alignment said: 16-byte loads. Triton can prove neither of a table's addresses nor of a mask against a
    # loaded size, and without both it reads one element per instruction.
    if (tl.load(table + 5 * count + k) != 0) & (local + CHUNK <= n):
        snapshot, old, new, nan = _read(table, count, k, offsets, inside, nan_bits, MODE, NAN_ABOVE, True)
    else:
        snapshot, old, new, nan = _read(table, count, k, offsets, inside, nan_bits, MODE, NAN_ABOVE, False)
    changed = (new != old) & inside
    flags = changed.to(tl.int32)
    # NOTE: one reduction for two counts, the changes (low 16 bits; CHUNK <= 2**14) and the changed NaNs (above):
    # each reduction is a round through shared memory between this program's loads and its stores.
    both = tl.sum(flags + ((nan & changed).to(tl.int32) << 16), axis=0)
    c = both & 0xFFFF
    if RESERVED:
        base = -tl.load(chunk_base + chunk) - 1
    else:
        tl.store(chunk_counts + chunk, c)
        tl.store(chunk_first + chunk, tl.load(table + 4 * count + k) + local)
        # A NaN among the changes: vLLM's patch loader reads NaN as "unchanged", so the tensor goes whole.
        if (both >> 16) > 0:
            tl.atomic_max(piece_nan + k, 1)
        base = chunk * SLOT
        if c > SLOT:
            base = slots + tl.atomic_add(cursor, c.to(tl.int64))
    if base + c <= limit:
        if c > 0:
            at = base + tl.cumsum(flags, axis=0) - 1
            tl.store(scratch_offset + at, tl.arange(0, CHUNK).to(tl.int16), mask=changed)
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
    chunks,
    chunk_counts,
    chunk_base,
    chunk_first,
    chunk_end,
    scratch_offset,
    scratch_bits,
    out_index,
    out_bits,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """GROUP chunks per program: each chunk's changes from its scratch range to their place in chunk order
    (`chunk_end`: the inclusive prefix sum of `chunk_counts`), as full-tensor indices (the chunk's first index plus
    the place in the chunk), BLOCK of each chunk at a time.

    NOTE: a plain copy of ranges, no table. GROUP chunks a program (not one) because most chunks hold a few dozen
    changes at 1-3% changed: one program each left the device idle.
    """
    group = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    real = group < chunks
    c = tl.load(chunk_counts + group, mask=real, other=0).to(tl.int64)
    base = tl.load(chunk_base + group, mask=real, other=0)
    first = tl.load(chunk_first + group, mask=real, other=0)
    to = tl.load(chunk_end + group, mask=real, other=0) - c
    most = tl.max(c, axis=0)
    for start in range(0, most, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        some = j[None, :] < c[:, None]
        offset = tl.load(scratch_offset + base[:, None] + j[None, :], mask=some, other=0)
        index = first[:, None] + offset.to(tl.int64)
        bits = tl.load(scratch_bits + base[:, None] + j[None, :], mask=some, other=0)
        tl.store(out_index + to[:, None] + j[None, :], index, mask=some)
        tl.store(out_bits + to[:, None] + j[None, :], bits, mask=some)
