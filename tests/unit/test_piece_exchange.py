"""`fsdp_sync.sync.pieces.PieceExchange` in one process: full tensors rebuilt from disjoint pieces in any order and
dtype, read afresh at every sync from what the gatherer holds, the kept route follows a changed layout, and a gap,
an overlap or a resized piece is refused by name. (Across ranks: every adapter test of tests/dist and tests/e2e, and
its faults in tests/dist/test_adapter_faults.py; the gatherers' own held pieces in tests/dist/test_held_pieces.py.)"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from fsdp_sync.gather.base import HeldPieces, Piece
from fsdp_sync.sync.pieces import PieceExchange

NAMES = ("a", "b", "c")
FULL = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.arange(7, dtype=torch.bfloat16) - 3,
    "c": torch.arange(5, dtype=torch.float32) * 10,
}


class _Held:
    """A gatherer's `held_pieces` over `pieces` (a list the test may change between syncs: what the shards hold)."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces = pieces

    def __call__(self, names: Sequence[str]) -> HeldPieces:
        mine = [p for p in self.pieces if p.name in names and p.values.numel()]
        places = tuple((names.index(p.name), p.start, p.values.numel()) for p in mine)
        return HeldPieces(places, lambda: [self._current(p) for p in mine])

    def _current(self, piece: Piece) -> torch.Tensor:
        # The same piece's values as the test holds them now (as a shard's storage is read at each sync).
        return next(p.values for p in self.pieces if p.name == piece.name and p.start == piece.start)


def _exchange(held: _Held) -> PieceExchange:
    return PieceExchange(NAMES, [tuple(FULL[n].shape) for n in NAMES], [FULL[n].dtype for n in NAMES], held)


def _pieces(cuts: dict[str, list[int]], full: dict[str, torch.Tensor] = FULL) -> list[Piece]:
    """Each tensor cut at `cuts[name]`, the pieces listed last first (order must not matter)."""
    pieces = []
    for name, at in cuts.items():
        flat = full[name].reshape(-1)
        bounds = [0, *at, flat.numel()]
        pieces += [Piece(name, flat[s:e].clone(), s) for s, e in zip(bounds, bounds[1:])]
    return pieces[::-1]


def _full(exchange: PieceExchange, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(exchange.order, tensors, strict=True))


def test_pieces_in_any_order_and_dtype_make_the_full_tensors_bit_for_bit() -> None:
    cuts = {"a": [5], "b": [], "c": [1, 4]}
    held = _Held(_pieces(cuts))
    exchange = _exchange(held)
    full = _full(exchange, exchange(exchange.pack(), receive=True))
    assert sorted(full) == sorted(NAMES)
    for name in NAMES:
        assert full[name].dtype == FULL[name].dtype and torch.equal(full[name], FULL[name]), name
    # A later sync reads the pieces afresh: the values are the new ones, and the earlier full tensors (kept by a
    # writer) are not changed by it.
    new = {n: t + 1 for n, t in FULL.items()}
    held.pieces = _pieces(cuts, new)
    later = _full(exchange, exchange(exchange.pack(), receive=True))
    assert all(torch.equal(later[n], new[n]) for n in NAMES)
    assert all(torch.equal(full[n], FULL[n]) for n in NAMES)


def test_one_held_tensor_is_copied_not_aliased() -> None:
    """At world size 1 the full tensors are views of the packed values: a lone held tensor must still be copied,
    or the adapter a writer keeps would change with the trainer's next step."""
    weight = FULL["a"].clone()
    exchange = PieceExchange(["a"], [tuple(weight.shape)], [weight.dtype],
                             lambda names: HeldPieces(((0, 0, weight.numel()),), lambda: [weight]))  # fmt: skip
    (full,) = exchange(exchange.pack(), receive=True)
    weight.add_(1)
    assert torch.equal(full, FULL["a"])


def test_a_rank_that_does_not_receive_gets_nothing() -> None:
    exchange = _exchange(_Held(_pieces({"a": [], "b": [], "c": []})))
    assert exchange(exchange.pack(), receive=False) == []


@pytest.mark.parametrize("fault", ["gap", "overlap"])
def test_pieces_that_do_not_cover_a_tensor_exactly_once_are_refused_by_name(fault: str) -> None:
    pieces = _pieces({"a": [5], "b": [], "c": [2]})
    if fault == "gap":
        pieces = [p for p in pieces if not (p.name == "c" and p.start == 2)]
    else:
        pieces.append(Piece("c", FULL["c"][1:3].clone(), 1))
    exchange = _exchange(_Held(pieces))
    with pytest.raises(RuntimeError, match=r"exactly once: c$"):
        exchange(exchange.pack(), receive=True)


def test_a_held_piece_that_changed_size_is_named() -> None:
    held = _Held(_pieces({"a": [5], "b": [], "c": [2]}))
    exchange = _exchange(held)
    held.pieces = [Piece(p.name, p.values[:1], p.start) if (p.name, p.start) == ("c", 2) else p for p in held.pieces]
    with pytest.raises(RuntimeError, match=r"changed size since the plan: c$"):
        exchange.pack()


def _as_two_ranks(monkeypatch: pytest.MonkeyPatch, theirs: list[list[Piece]]) -> None:
    """The exchange's all-gathers as two ranks would see them at each sync: this rank's (places, values) first, then
    those the second rank sends (`theirs[k]`: its pieces at sync k), each padded to the longest as `_exchange` pads
    them."""
    import fsdp_sync.sync.pieces as pieces

    sent: list[dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]] = []
    for other in theirs:
        capture: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

        def own(places: torch.Tensor, values: torch.Tensor, group: object, capture=capture) -> tuple:
            capture[values.dtype] = (places, values)
            return places.reshape(1, -1, 3), (values.numel(), ), values

        monkeypatch.setattr(pieces, "_exchange", own)
        exchange = _exchange(_Held(other))
        exchange(exchange.pack(), receive=False)
        sent.append(capture)
    syncs = iter(sent)
    current: dict[str, dict] = {}

    def two_ranks(places: torch.Tensor, values: torch.Tensor, group: object) -> tuple:
        if values.dtype not in current.get("sync", {}) or values.dtype in current.get("seen", set()):
            current["sync"], current["seen"] = next(syncs), set()
        current["seen"].add(values.dtype)
        theirs_places, their_values = current["sync"][values.dtype]
        most = max(places.shape[0], theirs_places.shape[0], 1)
        longest = max(values.numel(), their_values.numel(), 1)
        rows = torch.full((2, most, 3), -1, dtype=torch.int64)
        rows[0, : places.shape[0]], rows[1, : theirs_places.shape[0]] = places, theirs_places
        flat = torch.zeros(2 * longest, dtype=values.dtype)
        flat[: values.numel()], flat[longest : longest + their_values.numel()] = values, their_values
        return rows, (values.numel(), their_values.numel()), flat

    monkeypatch.setattr(pieces, "_exchange", two_ranks)


def _halves(cuts: dict[str, list[int]], drop: str = "") -> tuple[list[Piece], list[Piece]]:
    """FSDP's layout: each tensor's first part on this rank, the rest on the other (and "c" whole on the other)."""
    every = _pieces(cuts)
    mine = [p for p in every if p.start == 0 and p.name != "c"]
    return mine, [p for p in every if all(p is not q for q in mine) and p.name != drop]


def test_two_ranks_halves_interleave_into_the_full_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs are put in order from both ranks' blocks of the gathered buffer, across its padding."""
    mine, theirs = _halves({"a": [5], "b": [3], "c": []})
    _as_two_ranks(monkeypatch, [theirs])
    exchange = _exchange(_Held(mine))
    full = _full(exchange, exchange(exchange.pack(), receive=True))
    assert all(torch.equal(full[n], FULL[n]) for n in NAMES)


def test_a_changed_layout_of_another_rank_rebuilds_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    mine, theirs = _halves({"a": [5], "b": [3], "c": []})
    every = _pieces({"a": [5, 9], "b": [3, 6], "c": [2]})
    other_layout = [p for p in every if p.start != 0 or p.name == "c"]
    _as_two_ranks(monkeypatch, [theirs, other_layout])
    exchange = _exchange(_Held(mine))
    exchange(exchange.pack(), receive=True)
    full = _full(exchange, exchange(exchange.pack(), receive=True))
    assert all(torch.equal(full[n], FULL[n]) for n in NAMES)


def test_two_ranks_with_a_gap_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    mine, theirs = _halves({"a": [5], "b": [3], "c": []}, drop="b")
    _as_two_ranks(monkeypatch, [theirs])
    exchange = _exchange(_Held(mine))
    with pytest.raises(RuntimeError, match=r"exactly once: b$"):
        exchange(exchange.pack(), receive=True)
