"""The snapshot and patches of sparse delta syncs (`fsdp_sync.sync.snapshot`, `fsdp_sync.sync.patches`), in one process."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.gather.base import Piece
from fsdp_sync.sync.patches import Patch, gather_patches
from fsdp_sync.sync.snapshot import Snapshot


def _piece(values: torch.Tensor, start: int = 0, name: str = "w") -> Piece:
    return Piece(name, values, start)


def test_diff_finds_the_engine_dtype_changes_at_full_tensor_positions() -> None:
    old = torch.tensor([1.0, 2.0, 3.0, 4.0])
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([_piece(old, start=10)])
    new = old.clone()
    new[1] += 1e-4  # below bf16's resolution at 2.0: no change on the engine
    new[3] = 5.0
    patch = snapshot.diff([_piece(new, start=10)])["w"]
    assert patch.indices.tolist() == [13]
    assert patch.values.dtype == torch.bfloat16 and patch.values.tolist() == [5.0]
    # The snapshot now holds what this patch makes of the engine: the same values again are no change.
    assert snapshot.diff([_piece(new, start=10)])["w"].count == 0


def test_bit_changes_that_compare_equal_are_changes() -> None:
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([_piece(torch.tensor([0.0, float("nan")]))])
    patch = snapshot.diff([_piece(torch.tensor([-0.0, float("nan")]))])["w"]
    assert patch.indices.tolist() == [0]  # -0.0 == 0.0 numerically, but the engine's bits differ


def test_validity_follows_the_push() -> None:
    snapshot = Snapshot(torch.bfloat16)
    assert not snapshot.valid
    snapshot.take([_piece(torch.zeros(4))])
    assert not snapshot.valid and snapshot.nbytes == 8
    snapshot.commit()
    assert snapshot.valid
    snapshot.diff([_piece(torch.ones(4))])
    assert not snapshot.valid  # until the push of the patches succeeds
    snapshot.forget()
    assert not snapshot.valid and snapshot.nbytes == 0
    with pytest.raises(KeyError):
        snapshot.diff([_piece(torch.ones(4))])


def test_a_moved_piece_is_refused() -> None:
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([_piece(torch.zeros(4), start=0)])
    with pytest.raises(KeyError, match="moved"):
        snapshot.diff([_piece(torch.zeros(4), start=4)])


def test_one_process_joins_its_own_patches() -> None:
    snapshot = Snapshot(torch.bfloat16)
    snapshot.take([_piece(torch.zeros(6), name="a"), _piece(torch.zeros(3), name="b")])
    patches = snapshot.diff([_piece(torch.tensor([0, 0, 1.0, 0, 0, 2.0]), name="a"), _piece(torch.zeros(3), name="b")])
    joined = gather_patches(["a", "b"], patches, [torch.bfloat16] * 2, [6, 3], to_all=True)
    assert joined.totals == [2, 0]
    assert list(joined.patches) == ["a"] and joined.patches["a"].indices.tolist() == [2, 5]
    # Two changes of 2 bytes of index (low 16 bits) and 2 of value, and one count for the one block of "a".
    assert joined.wire_bytes == 2 * (2 + 2) + 4


def test_indices_across_blocks_round_trip() -> None:
    numel = 3 * 2**16 + 5
    # Low halves at and past 2**15 (negative as int16), block edges, an empty block (the second).
    indices = torch.tensor([0, 7, 2**15, 2**16 - 1, 2 * 2**16 + 40_000, 3 * 2**16 + 4])
    values = torch.arange(6, dtype=torch.bfloat16)
    joined = gather_patches(["w"], {"w": Patch(indices, values)}, [torch.bfloat16], [numel], to_all=True)
    got = joined.patches["w"]
    assert torch.equal(got.indices, indices) and torch.equal(got.values, values)
