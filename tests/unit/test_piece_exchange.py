"""`fsdp_sync.sync.pieces.PieceExchange` in one process: full tensors rebuilt from disjoint pieces in any order and
dtype, the kept route follows a changed layout, and a gap or an overlap is refused by name. (Across ranks: every
adapter test of tests/dist and tests/e2e, and its faults in tests/dist/test_adapter_faults.py.)"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.gather.base import Piece
from fsdp_sync.sync.pieces import PieceExchange

NAMES = ("a", "b", "c")
FULL = {
    "a": torch.arange(12, dtype=torch.float32),
    "b": torch.arange(7, dtype=torch.bfloat16) - 3,
    "c": torch.arange(5, dtype=torch.float32) * 10,
}


def _exchange() -> PieceExchange:
    return PieceExchange(NAMES, [FULL[n].numel() for n in NAMES], [FULL[n].dtype for n in NAMES])


def _pieces(cuts: dict[str, list[int]]) -> list[Piece]:
    """Each tensor cut at `cuts[name]`, the pieces listed last first (order must not matter)."""
    pieces = []
    for name, at in cuts.items():
        bounds = [0, *at, FULL[name].numel()]
        pieces += [Piece(name, FULL[name][s:e].clone(), s) for s, e in zip(bounds, bounds[1:])]
    return pieces[::-1]


def test_pieces_in_any_order_and_dtype_make_the_full_tensors_bit_for_bit() -> None:
    exchange = _exchange()
    full = exchange(_pieces({"a": [5], "b": [], "c": [1, 4]}), receive=True)
    assert sorted(full) == sorted(NAMES)
    for name in NAMES:
        assert full[name].dtype == FULL[name].dtype and torch.equal(full[name], FULL[name]), name
    # A later sync with other values takes the kept route: the values are the new ones.
    new = {n: t + 1 for n, t in FULL.items()}
    later = exchange([Piece(p.name, new[p.name][p.start : p.start + p.values.numel()], p.start)
                      for p in _pieces({"a": [5], "b": [], "c": [1, 4]})], receive=True)  # fmt: skip
    assert all(torch.equal(later[n], new[n]) for n in NAMES)


def test_a_changed_layout_rebuilds_the_route() -> None:
    exchange = _exchange()
    exchange(_pieces({"a": [5], "b": [], "c": [2]}), receive=True)
    full = exchange(_pieces({"a": [3, 9], "b": [6], "c": []}), receive=True)
    assert all(torch.equal(full[n], FULL[n]) for n in NAMES)


def test_a_rank_that_does_not_receive_gets_nothing() -> None:
    assert _exchange()(_pieces({"a": [], "b": [], "c": []}), receive=False) == {}


@pytest.mark.parametrize("fault", ["gap", "overlap"])
def test_pieces_that_do_not_cover_a_tensor_exactly_once_are_refused_by_name(fault: str) -> None:
    pieces = [p for p in _pieces({"a": [5], "b": [], "c": [2]})]
    if fault == "gap":
        pieces = [p for p in pieces if not (p.name == "c" and p.start == 2)]
    else:
        pieces.append(Piece("c", FULL["c"][1:3].clone(), 1))
    with pytest.raises(RuntimeError, match=r"exactly once: c$"):
        _exchange()(pieces, receive=True)
