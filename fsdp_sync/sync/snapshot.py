"""What the engine holds for this rank's pieces of the patchable tensors, and the diff against it: the snapshot of
sparse syncs (`fsdp_sync.sync.sparse`, which says when it is taken, trusted and forgotten).

Why a module of its own: it is this rank's tensor work alone (no plan, no ranks, no engine), with the extraction
kernels on CUDA (`fsdp_sync.kernels.extract`, whose torch reference is `Snapshot._diff_one`) and its own tests
(`tests/unit/test_sparse.py`, `tests/unit/kernels/test_extract.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..gather.base import Piece
from ..kernels import runtime as kernels
from ..kernels.extract import Extractor, Kind, kind_of
from .patches import Patch

__all__ = ["Snapshot"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


class Snapshot:
    """What the engine holds for this rank's pieces, in the engine dtype.

    Args:
        dtype: the engine dtype floating pieces are cast to (None: keep each piece's own).
    """

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._held: dict[str, tuple[int, torch.Tensor]] = {}
        self._valid = False
        self._extractors: dict[tuple[Kind, torch.device], Extractor] = {}  # their tables: of the held tensors

    @property
    def valid(self) -> bool:
        """Whether the engine holds the snapshot (a push of it succeeded and nothing since made it doubtful)."""
        return self._valid

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._held.values())

    def _cast(self, values: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if self.dtype is not None and values.is_floating_point() else values.dtype
        return values.detach().reshape(-1).to(dtype, copy=True)

    def take(self, pieces: Iterable[Piece]) -> None:
        """Hold these pieces (as the engine dtype) as what the engine holds: after a dense push of them."""
        self._held = {p.name: (p.start, self._cast(p.values)) for p in pieces}

    def commit(self) -> None:
        """The push of the held values succeeded: the next sync may be sparse."""
        self._valid = True

    def forget(self) -> None:
        """The engine may hold anything (a failed push, a restart): the next sync is dense and takes it again."""
        self._held = {}
        self._valid = False

    def diff(self, pieces: Iterable[Piece]) -> dict[str, Patch]:
        """The changed elements of each piece since the snapshot, as full-tensor positions; the snapshot then holds
        the new values (call `commit` once they are pushed, `forget` when the push failed).

        NOTE: where the kernels run (CUDA), the pieces they read (`extract.kind_of`) go through one extraction of
        two launches per kind (`fsdp_sync.kernels.extract`: the same patches, bit for bit, written into the snapshot
        in place); the others one by one, in torch.

        Raises:
            KeyError: a piece the snapshot does not hold (the sync's structure changed: take it again).
        """
        patches: dict[str, Patch | None] = {}
        batched: dict[tuple[Kind, torch.device], list[tuple[str, torch.Tensor, torch.Tensor, int]]] = {}
        for piece in pieces:
            start, old = self._held[piece.name]
            if start != piece.start or old.numel() != piece.values.numel():
                raise KeyError(f"{piece.name}: the piece moved since the snapshot (start {start} -> {piece.start})")
            kind = kind_of(piece.values, old) if kernels.usable(old.device) else None
            if kind is None:
                patches[piece.name] = self._diff_one(piece, start, old)
            else:
                patches[piece.name] = None  # in stream order; filled below
                batched.setdefault((kind, old.device), []).append((piece.name, piece.values.detach(), old, start))
        for key, items in batched.items():
            extractor = self._extractors.get(key)
            if extractor is None:
                extractor = self._extractors[key] = Extractor(key[0])
            found = extractor([new for _, new, _, _ in items], [old for _, _, old, _ in items],
                              [start for *_, start in items])  # fmt: skip
            for (name, *_), (indices, values, nan) in zip(items, found, strict=True):
                patches[name] = Patch(indices, values, nan)
        self._valid = False
        return patches  # type: ignore[return-value]

    def _diff_one(self, piece: Piece, start: int, old: torch.Tensor) -> Patch:
        """The torch path of one piece (the reference of the kernels)."""
        new = self._cast(piece.values)
        local = torch.nonzero(_bits(new) != _bits(old)).reshape(-1)
        self._held[piece.name] = (start, new)
        return Patch(local + start, new[local])
