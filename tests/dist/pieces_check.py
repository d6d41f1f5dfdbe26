"""The oracle of `Gatherer.held_pieces`: the same pieces as `local_pieces`, read afresh at every sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_sync.gather.base import Gatherer, HeldPieces


def held_mismatches(gatherer: Gatherer, held: HeldPieces, names: Sequence[str]) -> list[str]:
    """The names whose held piece (its place, or its values as `read()` gives them now) differs from the piece
    `local_pieces` lists now, bit for bit; a place held without a listed piece, or the reverse, is named too."""
    listed = {(names.index(p.name), p.start, p.values.numel()): p for p in gatherer.local_pieces(names) if p.values.numel()}
    wrong = {names[i] for i, start, count in set(listed) ^ set(held.places)}
    flat = torch.cat([t.detach().reshape(-1) for t in held.read()]) if held.places else torch.empty(0)
    at = 0
    for place in held.places:
        values = flat[at : at + place[2]]
        at += place[2]
        piece = listed.get(place)
        if piece is not None and not torch.equal(values, piece.values.detach().to(values.dtype)):
            wrong.add(names[place[0]])
    if at != flat.numel():
        wrong.update(names)
    return sorted(wrong)
