"""`fsdp_sync.kernels.extract`: sparse extraction on the GPU gives the torch path's patches and snapshot, bit for bit.

Why: a sparse sync sends only the elements whose engine-dtype bits changed since the snapshot; the kernel replaces
the torch path (`Snapshot._diff_one`) where it runs, so every bit pattern must compare as there (signed zeros, NaN
payloads, subnormals, infinities), the cast from float32 must round as torch rounds, the changes of every piece
must come out ascending with their values, and the snapshot must end up holding exactly the new values. Each test
diffs two snapshots of the same pieces, one through the kernel and one through the torch path, and compares.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.kernels.extract import CHUNK, kind_of
from fsdp_sync.gather.base import Piece
from fsdp_sync.sync.patches import Patch, count_changes
from fsdp_sync.sync.snapshot import Snapshot

from .support import needs_kernels

pytestmark = needs_kernels

_INT = {2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _reference(snapshot: Snapshot, pieces: list[Piece]) -> dict[str, Patch]:
    """The torch path of every piece (what runs where the kernels do not)."""
    patches = {}
    for piece in pieces:
        start, old = snapshot._held[piece.name]
        patches[piece.name] = snapshot._diff_one(piece, start, old)
    return patches


def _diff_both(before: list[Piece], after: list[Piece], dtype: torch.dtype) -> tuple[Snapshot, dict[str, Patch]]:
    """Snapshots of `before` diffed against `after` through the kernel and through the torch path; asserts that the
    patches, their NaN flags and the snapshots are equal bit for bit, and returns the kernel's."""
    kernel, torch_path = Snapshot(dtype), Snapshot(dtype)
    kernel.take(before)
    torch_path.take(before)
    assert all(kind_of(p.values, kernel._held[p.name][1]) is not None for p in after), "the kernel reads every piece"
    got = kernel.diff(after)
    assert kernel._extractors, "the kernel ran"
    want = _reference(torch_path, after)
    assert list(got) == [p.name for p in after]
    for piece in after:
        g, w = got[piece.name], want[piece.name]
        assert g.indices.dtype == torch.int64 and g.values.dtype == w.values.dtype, piece.name
        assert torch.equal(g.indices, w.indices), piece.name
        assert torch.equal(_bits(g.values), _bits(w.values)), piece.name
        assert g.nan == bool(torch.isnan(w.values).any()), piece.name
        assert torch.equal(_bits(kernel._held[piece.name][1]), _bits(torch_path._held[piece.name][1])), piece.name
    return kernel, got


def _from_bits(words: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    wide = torch.tensor(words, dtype=torch.int64)
    if dtype.itemsize == 2:
        return torch.where(wide >= 1 << 15, wide - (1 << 16), wide).to(torch.int16).view(dtype).to(device)
    return torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32).view(dtype).to(device)


def test_every_bfloat16_bit_pattern_compares_as_the_torch_path(device: torch.device) -> None:
    """All 65536 patterns against a shifted copy of themselves (every pattern changes into another), then against
    themselves except a few that turn into their twins: -0.0 after 0.0, another NaN payload, the next subnormal."""
    every = list(range(1 << 16))
    old = _from_bits(every, torch.bfloat16, device)
    new = _from_bits(every[7:] + every[:7], torch.bfloat16, device)
    _diff_both([Piece("w", old, 0)], [Piece("w", new, 0)], torch.bfloat16)
    twins = {0x0000: 0x8000, 0x7FC0: 0x7FC1, 0xFFC0: 0x7FC0, 0x7F81: 0x7F82, 0x0001: 0x0002, 0x8001: 0x0001,
             0x007F: 0x0080, 0x7F80: 0xFF80, 0x7F7F: 0x7F80}  # fmt: skip
    changed = [twins.get(w, w) for w in every]
    _, patches = _diff_both([Piece("w", old, 0)], [Piece("w", _from_bits(changed, torch.bfloat16, device), 0)],
                            torch.bfloat16)  # fmt: skip
    assert patches["w"].indices.tolist() == sorted(twins)
    assert patches["w"].nan, "NaN payloads changed"


def test_float32_values_cast_to_bfloat16_as_torch_rounds(device: torch.device) -> None:
    """Ties to even, signed zeros, float32 subnormals, overflow to infinity, infinities, NaNs of any payload, and
    random bit patterns over the whole range, cast on the way and compared with a bfloat16 snapshot."""
    edges = [0x00000000, 0x80000000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x00000001, 0x80000001,
             0x007FFFFF, 0x00008000, 0x00018000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000,
             0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA00123, 0x33800000, 0x3F800000]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (20_000,), generator=generator, dtype=torch.int64)
    words = edges + [w & 0xFFFFFFFF for w in random_bits.tolist()]
    before = _from_bits(words[5:] + words[:5], torch.float32, device)
    after = _from_bits(words, torch.float32, device)
    _diff_both([Piece("w", before, 0)], [Piece("w", after, 0)], torch.bfloat16)
    # Unchanged values (their cast equal to the snapshot) are not patches; a NaN that stayed is not one either.
    _, patches = _diff_both([Piece("w", after, 0)], [Piece("w", after.clone(), 0)], torch.bfloat16)
    assert patches["w"].count == 0 and patches["w"].nan is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_many_pieces_of_every_size_in_one_call(dtype: torch.dtype, device: torch.device) -> None:
    """Pieces around the chunk size, empty ones and their starts in the full tensor; at 3% of elements changed and
    at 60% (more than the first scratch holds: the chunks that did not fit are finished in a second launch)."""
    generator = torch.Generator().manual_seed(1)
    sizes = [0, 3, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 0, 40_000]
    before = [Piece(f"p{k}", torch.randn(n, generator=generator).to(dtype).to(device), 1000 * k)
              for k, n in enumerate(sizes)]  # fmt: skip
    for share, relaunched in ((0.03, 0), (0.6, 1)):
        after = []
        for piece in before:
            values = piece.values.clone()
            hit = (torch.rand(values.numel(), generator=generator) < share).to(device)
            values[hit] = values[hit] * 2 + 1
            after.append(Piece(piece.name, values, piece.start))
        kernel, patches = _diff_both(before, after, dtype)
        (extractor,) = kernel._extractors.values()
        assert extractor.relaunched == relaunched
        assert sum(p.count for p in patches.values()) > share * sum(sizes) / 2


def test_the_plan_is_kept_while_the_pieces_stay_and_rebuilt_when_they_move(device: torch.device) -> None:
    """Two diffs over the same pieces and snapshot reuse the table; a snapshot taken again (new tensors) rebuilds
    it, and each diff finds exactly the changes since the one before."""
    values = torch.randn(10_000, device=device).to(torch.bfloat16)
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([Piece("w", values, 0)])
    values[[5, 9000]] += 1
    assert snapshot.diff([Piece("w", values, 0)])["w"].indices.tolist() == [5, 9000]
    ((key, plan),) = [e._plan for e in snapshot._extractors.values()]  # type: ignore[misc]
    values[[17]] += 1
    assert snapshot.diff([Piece("w", values, 0)])["w"].indices.tolist() == [17]
    (extractor,) = snapshot._extractors.values()
    assert extractor._plan is not None and extractor._plan[1] is plan
    snapshot.take([Piece("w", values, 0)])
    values[[3]] += 1
    assert snapshot.diff([Piece("w", values, 0)])["w"].indices.tolist() == [3]
    assert extractor._plan[1] is not plan


def test_the_nan_flag_counts_only_changed_values(device: torch.device) -> None:
    """`count_changes` reads the kernel's flag: a NaN that stayed as it was is no patch value; one that appeared
    is (vLLM's patch loader would read it as "unchanged", so its tensor goes whole)."""
    values = torch.randn(5000, device=device).to(torch.bfloat16)
    values[10] = float("nan")
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([Piece("a", values, 0), Piece("b", values.clone(), 0)])
    stayed, appeared = values.clone(), values.clone()
    stayed[20] += 1
    appeared[30] = float("nan")
    patches = snapshot.diff([Piece("a", stayed, 0), Piece("b", appeared, 0)])
    assert patches["a"].nan is False and patches["b"].nan is True
    counts = count_changes(["a", "b"], patches)
    assert counts.nan == (False, True) and counts.totals == [1, 1]


@pytest.mark.parametrize(("dtype", "engine"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])  # fmt: skip
def test_pieces_at_unaligned_addresses_read_as_aligned_ones(dtype: torch.dtype, engine: torch.dtype,
                                                            device: torch.device) -> None:  # fmt: skip
    """Whole chunks of pieces that start between 16-byte words (an FSDP shard can start at any element) take the
    masked path, those of aligned pieces the aligned one: both give the torch path's patches."""
    generator = torch.Generator().manual_seed(3)
    storage = torch.randn(12 * CHUNK + 64, generator=generator).to(dtype).to(device)
    shifts = [0, 1, 3, 8]
    before = [Piece(f"p{k}", storage[shift: shift + 2 * CHUNK + 5 * k], 7 * k) for k, shift in enumerate(shifts)]
    aligned = [p.values.data_ptr() % 16 == 0 for p in before]
    assert aligned == [True, False, False, True], "both paths are exercised"
    after = []
    for piece in before:
        values = piece.values.clone()  # a fresh (aligned) tensor of the same values ...
        hit = (torch.rand(values.numel(), generator=generator) < 0.05).to(device)
        values[hit] = values[hit] * 3 - 1
        shifted = torch.empty(values.numel() + 1, dtype=dtype, device=device)[1:]  # ... or one that starts unaligned
        shifted.copy_(values)
        after.append(Piece(piece.name, shifted if piece.values.data_ptr() % 16 else values, piece.start))
    _diff_both(before, after, engine)


@pytest.mark.parametrize(("chunk", "warps"), [(256, 4), (512, 8), (2048, 4)])
def test_every_launch_shape_gives_the_torch_path(chunk: int, warps: int, device: torch.device) -> None:
    """The launch shapes the benchmark sweeps (smaller chunks here, so that the compaction runs more programs of
    many chunks each than one), at 2% changed and at 70% (more changes in a chunk than one copy block)."""
    from fsdp_sync.kernels.extract import Extractor

    generator = torch.Generator().manual_seed(4)
    sizes = [40_000, 0, 5, chunk * 40 + 3]
    before = [Piece(f"p{k}", torch.randn(n, generator=generator).to(torch.bfloat16).to(device), 11 * k)
              for k, n in enumerate(sizes)]  # fmt: skip
    for share in (0.02, 0.7):
        after = []
        for piece in before:
            values = piece.values.clone()
            hit = (torch.rand(values.numel(), generator=generator) < share).to(device)
            values[hit] = values[hit] * 2 + 1
            after.append(Piece(piece.name, values, piece.start))
        kernel, torch_path = Snapshot(torch.bfloat16), Snapshot(torch.bfloat16)
        kernel.take(before)
        torch_path.take(before)
        kind = kind_of(after[0].values, kernel._held["p0"][1])
        kernel._extractors[(kind, kernel._held["p0"][1].device)] = Extractor(kind, chunk=chunk, warps=warps)
        got, want = kernel.diff(after), _reference(torch_path, after)
        for piece in after:
            assert torch.equal(got[piece.name].indices, want[piece.name].indices), piece.name
            assert torch.equal(_bits(got[piece.name].values), _bits(want[piece.name].values)), piece.name
            assert torch.equal(_bits(kernel._held[piece.name][1]), _bits(torch_path._held[piece.name][1])), piece.name
        assert sum(p.count for p in got.values()) > share * sum(sizes) / 2
        before = after
