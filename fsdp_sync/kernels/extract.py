"""Sparse extraction on the GPU: compare every piece with its snapshot, count and compact the changes, and write them
into the snapshot, in two launches whatever the number of pieces.

Why: the torch path (`fsdp_sync.sync.snapshot.Snapshot.diff`, kept on the CPU and as the reference) casts each piece
(read 4, write 2 bytes an element), compares the bits with the snapshot (read 2 + 2), and `torch.nonzero` then waits
for the device, once per piece: at 7B shapes it ran at 5-6x the bytes' floor on an H200 (docs/sparse.md). What it
must move is the new values and the snapshot, each read once, and the few changes written: 4 bytes an element from
bfloat16 shards (6 from float32 ones, cast on the way), plus a few bytes per change.

How: `diff_kernel` (extract_triton.py) reads each chunk of CHUNK elements once, compares the bits (after the cast,
where the piece is float32 and the snapshot bfloat16), and writes the chunk's changes, in order, as places in the
chunk, into the chunk's own slot of a scratch buffer (CHUNK / SLOT_SHARE entries; a chunk with more changes reserves a
range of the scratch's overflow region with one atomic), and into the snapshot; `compact_kernel` then copies each
chunk's changes to their place in chunk order as indices into the full tensor (GROUP chunks a program), so each
piece's changes come out ascending, exactly as the torch path gives them. The overflow region holds what the last
call needed plus a quarter; a call that needs more finishes the chunks that did not fit in a second launch (they
wrote nothing, not even the snapshot). The slots cost 4 bytes an entry (6 from float32 pieces) for a sixteenth of the
elements, about a quarter of a byte an element, held while a call runs. The table of the pieces' addresses and the
chunk-to-piece map are built once and kept while the pieces do not move; one read of a few integers per piece comes
back to the host, through pinned memory, once per call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .runtime import HostReadback

__all__ = ["Extractor", "Kind", "kind_of"]

# Elements per program: one chunk is read once and held in registers while its changes are counted and compacted.
# NOTE: chosen by `python -m benchmarks.run kernels --sweep` on one H100
# (benchmarks/results/kernels-h100-2026-12-06.md): at 7B shapes 1024 elements and 4 warps ran at 2.91x the floor,
# 4096 and 8 at 3.77x, 512 and 2 at 3.31x; with the slots, the same sweep kept it: 2.58x, against 2.63-3.19x for
# the other shapes (benchmarks/results/kernels-d597aa5-h100-2026-12-06.md).
CHUNK = 1024
_WARPS = 4
# Chunks per program of the compaction, and changes of each chunk copied at a time.
_GROUP = 32
_BLOCK = 32
# Each chunk's slot: CHUNK // SLOT_SHARE changes (6.25% of its elements); a chunk with more takes the overflow region.
# NOTE: the slots replaced one range per chunk reserved on a single atomic counter (issue 41): at 1-3% changed
# almost no chunk overflows, so almost no program waits on an atomic.
SLOT_SHARE = 16
# The overflow region of a first call: this share of the elements (more is finished in a second launch).
_FIRST_SHARE = 1024


@dataclass(frozen=True)
class Kind:
    """How a group of pieces is compared: `mode` (extract_triton's SAME_16, SAME_32 or BF16_OF_FP32), the NaN bound
    on the compared bits (bits & ~sign above it: NaN), and the bits torch gives a NaN cast to bfloat16 (cast modes)."""

    mode: int
    nan_above: int
    nan_bits: int = 0


_SAME = {torch.bfloat16: Kind(0, 0x7F80), torch.float16: Kind(0, 0x7C00), torch.float32: Kind(1, 0x7F800000)}


@functools.cache
def _cast_nan_bits(device: torch.device) -> int | None:
    """The bits torch gives any float32 NaN cast to bfloat16 on `device` (0xFFFF on the CPU, 0x7FFF with CUDA's
    conversion), or None where they differ between NaNs (then the kernel could not match torch: no fused cast)."""
    words = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA00123]
    nans = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32).to(device)
    bits = set((nans.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist())
    return bits.pop() if len(bits) == 1 else None


def kind_of(new: torch.Tensor, snapshot: torch.Tensor) -> Kind | None:
    """How the kernel compares a piece's new values with its snapshot (both 1-D, one device), or None where it does not
    (the torch path takes them): the same floating dtype, or float32 values for a bfloat16 snapshot."""
    if new.device != snapshot.device or not (new.is_contiguous() and snapshot.is_contiguous()):
        return None
    if new.dtype == snapshot.dtype:
        return _SAME.get(new.dtype)
    if new.dtype == torch.float32 and snapshot.dtype == torch.bfloat16:
        nan_bits = _cast_nan_bits(new.device)
        return None if nan_bits is None else Kind(2, 0, nan_bits)
    return None


@dataclass
class _Plan:
    """What a call over the same pieces reuses: the table and the chunk layout."""

    table: torch.Tensor
    chunks: int
    chunk_row: torch.Tensor  # per chunk, the row of its piece (int32), on the device
    last_chunk: torch.Tensor  # per piece, its last chunk (-1: none), on the device


class Extractor:
    """Sparse extraction of one kind of pieces (`Kind`), in two launches per call; the table and the scratch's size
    are kept between calls (the pieces of a snapshot do not move).

    Args:
        kind: how the pieces are compared.
        chunk: elements per program of the extraction (a power of two; `CHUNK` unless a benchmark sweeps it).
        warps: warps per program of the extraction.
    """

    def __init__(self, kind: Kind, *, chunk: int = CHUNK, warps: int = _WARPS) -> None:
        if not SLOT_SHARE <= chunk <= 2**14:
            raise ValueError(f"chunk {chunk}: between {SLOT_SHARE} and {2**14} elements (places in it are int16)")
        self.kind = kind
        self.chunk = chunk
        self.warps = warps
        self._plan: tuple[tuple[int, ...], _Plan] | None = None
        self._readback = HostReadback()
        self._capacity = 0
        self.relaunched = 0  # calls whose scratch was too small (for tests and benchmarks)

    def __call__(
        self, news: Sequence[torch.Tensor], snapshots: Sequence[torch.Tensor], starts: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Per piece: the ascending indices into its full tensor (its start plus the position in the piece) where the
        new values differ from the snapshot in any bit, the new values there (the snapshot's dtype), and whether one
        of them is NaN. The snapshots then hold the new values.

        The new values and snapshots stay alive and unchanged by others until this returns (it waits for the device
        once).
        """
        from .extract_triton import compact_kernel, diff_kernel

        if not news:
            return []
        device = news[0].device
        plan = self._plan_of(news, snapshots, starts, device)
        numel = sum(n.numel() for n in news)
        slot = self.chunk // SLOT_SHARE
        slots = plan.chunks * slot
        capacity = max(self._capacity, numel // _FIRST_SHARE + self.chunk)
        bits_dtype = torch.int32 if self.kind.mode == 1 else torch.int16
        chunk_counts = torch.empty(plan.chunks, dtype=torch.int32, device=device)
        chunk_base = torch.empty(plan.chunks, dtype=torch.int64, device=device)
        chunk_first = torch.empty(plan.chunks, dtype=torch.int64, device=device)
        piece_nan = torch.zeros(len(news), dtype=torch.int32, device=device)
        cursor = torch.zeros(1, dtype=torch.int64, device=device)
        scratch_offset = torch.empty(slots + capacity, dtype=torch.int16, device=device)
        scratch_bits = torch.empty(slots + capacity, dtype=bits_dtype, device=device)
        count, kind = len(news), self.kind
        launch = dict(CHUNK=self.chunk, SLOT=slot, MODE=kind.mode, NAN_ABOVE=kind.nan_above, num_warps=self.warps)
        if plan.chunks:
            diff_kernel[(plan.chunks,)](plan.table, count, plan.chunk_row, cursor, chunk_counts, chunk_base,
                                        chunk_first, piece_nan, cursor, scratch_offset, scratch_bits, slots,
                                        slots + capacity, kind.nan_bits, RESERVED=False, **launch)  # fmt: skip
        chunk_end = torch.cumsum(chunk_counts, 0)
        if plan.chunks:
            ends = torch.where(plan.last_chunk >= 0, chunk_end[plan.last_chunk.clamp(min=0)], 0)
            changes = chunk_end[-1:]
        else:
            ends = torch.zeros(count, dtype=torch.int64, device=device)
            changes = torch.zeros(1, dtype=torch.int64, device=device)
        read = self._readback.read(cursor, ends, piece_nan, changes)
        reserved, piece_ends, nans, changed = (t.tolist() for t in read)
        overflow, total = reserved[0], changed[0]
        if overflow > capacity:
            # The chunks that did not fit wrote nothing: finish them where they reserved, in a scratch of the size.
            self.relaunched += 1
            ids = torch.nonzero(chunk_base < 0).reshape(-1)
            wider_offset = torch.empty(slots + overflow, dtype=torch.int16, device=device)
            wider_bits = torch.empty(slots + overflow, dtype=bits_dtype, device=device)
            wider_offset[: slots + capacity] = scratch_offset
            wider_bits[: slots + capacity] = scratch_bits
            scratch_offset, scratch_bits = wider_offset, wider_bits
            diff_kernel[(ids.numel(),)](plan.table, count, plan.chunk_row, ids, chunk_counts, chunk_base, chunk_first,
                                        piece_nan, cursor, scratch_offset, scratch_bits, slots, slots + overflow,
                                        kind.nan_bits, RESERVED=True, **launch)  # fmt: skip
        self._capacity = overflow + overflow // 4 + self.chunk
        out_index = torch.empty(total, dtype=torch.int64, device=device)
        out_bits = torch.empty(total, dtype=bits_dtype, device=device)
        if total:
            compact_kernel[(-(-plan.chunks // _GROUP),)](plan.chunks, chunk_counts, chunk_base, chunk_first,
                                                         chunk_end, scratch_offset, scratch_bits, out_index,
                                                         out_bits, GROUP=_GROUP, BLOCK=_BLOCK,
                                                         num_warps=4)  # fmt: skip
        values = out_bits.view(snapshots[0].dtype)
        out: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        begin = 0
        for end, nan in zip(piece_ends, nans, strict=True):
            end = max(end, begin)  # a piece with no chunk reads 0: it ends where it begins
            out.append((out_index[begin:end], values[begin:end], bool(nan)))
            begin = end
        return out

    def _plan_of(
        self,
        news: Sequence[torch.Tensor],
        snapshots: Sequence[torch.Tensor],
        starts: Sequence[int],
        device: torch.device,
    ) -> _Plan:
        """The plan of these pieces: kept while their addresses, sizes and starts are the last call's."""
        sizes = [n.numel() for n in news]
        addresses = ([n.data_ptr() for n in news], [s.data_ptr() for s in snapshots])
        aligned = [int(a % 16 == 0 and b % 16 == 0) for a, b in zip(*addresses, strict=True)]
        columns = (*addresses, sizes, [], list(starts), aligned)
        chunks = 0
        last = []
        per_piece = []
        for size in sizes:
            columns[3].append(chunks)
            per_piece.append(-(-size // self.chunk))
            chunks += per_piece[-1]
            last.append(chunks - 1 if size else -1)
        key = tuple(columns[0]) + tuple(columns[1]) + tuple(sizes) + tuple(starts)
        if self._plan is None or self._plan[0] != key:
            rows = torch.arange(len(news), dtype=torch.int32, device=device)
            plan = _Plan(
                table=torch.tensor(columns, dtype=torch.int64).reshape(-1).to(device),
                chunks=chunks,
                chunk_row=torch.repeat_interleave(rows, torch.tensor(per_piece, dtype=torch.int64, device=device),
                                                  output_size=chunks),
                last_chunk=torch.tensor(last, dtype=torch.int64).to(device),
            )
            self._plan = (key, plan)
        return self._plan[1]
