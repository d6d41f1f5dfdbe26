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


def _gathered_as_two_ranks(monkeypatch: pytest.MonkeyPatch, other: list[Piece]) -> None:
    """The exchange's all-gathers as two ranks would see them: this rank's (places, values) first, then those
    `other` (the second rank's pieces) sends, each padded to the longest as `_exchange` pads them."""
    import fsdp_sync.sync.pieces as pieces

    sent: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(places: torch.Tensor, values: torch.Tensor, group: object) -> tuple:
        sent[values.dtype] = (places, values)
        return places.reshape(1, -1, 3), (values.numel(),), values

    monkeypatch.setattr(pieces, "_exchange", capture)
    _exchange()(other, receive=False)

    def two_ranks(places: torch.Tensor, values: torch.Tensor, group: object) -> tuple:
        theirs, their_values = sent[values.dtype]
        most = max(places.shape[0], theirs.shape[0], 1)
        longest = max(values.numel(), their_values.numel(), 1)
        rows = torch.full((2, most, 3), -1, dtype=torch.int64)
        rows[0, : places.shape[0]], rows[1, : theirs.shape[0]] = places, theirs
        flat = torch.zeros(2 * longest, dtype=values.dtype)
        flat[: values.numel()], flat[longest : longest + their_values.numel()] = values, their_values
        return rows, (values.numel(), their_values.numel()), flat

    monkeypatch.setattr(pieces, "_exchange", two_ranks)


def test_two_ranks_halves_interleave_into_the_full_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP's layout: each tensor's first part on one rank, the rest on the other (and one tensor whole on rank 1):
    the runs are put in order from both ranks' blocks of the gathered buffer, across its padding."""
    every = _pieces({"a": [5], "b": [3], "c": []})
    mine = [p for p in every if p.start == 0 and p.name != "c"]
    theirs = [p for p in every if all(p is not q for q in mine)]
    _gathered_as_two_ranks(monkeypatch, theirs)
    full = _exchange()(mine, receive=True)
    assert all(torch.equal(full[n], FULL[n]) for n in NAMES)


def test_two_ranks_with_a_gap_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    every = _pieces({"a": [5], "b": [3], "c": []})
    mine = [p for p in every if p.start == 0 and p.name != "c"]
    theirs = [p for p in every if all(p is not q for q in mine) and p.name != "b"]
    _gathered_as_two_ranks(monkeypatch, theirs)
    with pytest.raises(RuntimeError, match=r"exactly once: b$"):
        _exchange()(mine, receive=True)
