"""Fingerprints of tensors, each computed where the tensor lives: what the delta check (`fsdp_sync.sync.delta`)
compares to prove that the weights a sync skipped did not change since they were last pushed.

Why a module of its own: it is tensor work alone (no plan, no ranks, no engine), with a kernel on CUDA
(`fsdp_sync.bitsums`) and its own tests (`tests/unit/kernels/test_bitsums.py`, `tests/unit/test_delta.py`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from .. import bitsums
from ..kernels import runtime as kernels

__all__ = ["Fingerprinter", "fingerprints"]

_PERIOD = 8191  # a prime: positions are weighted by (j mod _PERIOD) and by (j // _PERIOD)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A fingerprint of the tensor's raw bits, as three int64 values, computed where the tensor lives.

    On the CPU: the CRC-32 of its bytes (zlib; 10 ms for 60 MB measured on the 2-core test machine, against 60-70 ms
    for one int64 reduction pass there), which detects every change of one element up to 4 bytes wide and any other
    change but with probability 2^-32. On an accelerator (no copy to the host): three int64 sums over the bits x_j,
    sum(x_j), sum((j mod P) x_j) and sum((j // P) x_j); two swapped elements i != j leave all three equal only if
    i = j mod P and i // P = j // P, i.e. never, and any single changed element changes the first. On CUDA one
    Triton pass over all watched tensors (`fingerprints`, `fsdp_sync.bitsums`); elsewhere reductions over a (rows, P)
    view with int64 accumulation, so no int64 copy of the tensor is made.
    """
    return _crc_fingerprint(tensor) if tensor.device.type == "cpu" else _sum_fingerprint(tensor)


def _crc_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
    return torch.tensor([zlib.crc32(data), tensor.numel(), 0], dtype=torch.int64)


def _sum_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.view(torch.uint8)
    # NOTE: summed as 8-byte words where the size and the start allow (native int64 sums, a quarter of the elements
    # of bf16): a changed element changes its word, and a swap within a word changes the word unless both are equal.
    # A view that starts between words (a shard at an odd offset of its flat buffer) is summed by element: torch
    # cannot view it as int64 (found on an H100, where this path runs; the CPU takes the CRC).
    if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
        bits = raw.view(torch.int64)
    else:
        bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() or flat.is_complex() else flat
    rows = bits.numel() // _PERIOD
    main, tail = bits[: rows * _PERIOD].view(rows, _PERIOD), bits[rows * _PERIOD :]
    positions = _positions(bits.device, max(_PERIOD, rows))
    columns = main.sum(dim=0, dtype=torch.int64)  # per position mod P
    per_row = main.sum(dim=1, dtype=torch.int64)  # per row (j // P)
    tail64 = tail.to(torch.int64)
    return torch.stack(
        [
            columns.sum() + tail64.sum(),
            (columns * positions[:_PERIOD]).sum() + (tail64 * positions[: tail64.numel()]).sum(),
            (per_row * positions[:rows]).sum() + rows * tail64.sum(),
        ]
    )


_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _positions(device: torch.device, n: int) -> torch.Tensor:
    """0, 1, 2, ... (int64) on `device`, at least `n` long; kept between calls."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = _POSITIONS[device] = torch.arange(max(n, 2 * _PERIOD), dtype=torch.int64, device=device)
    return cached


class Fingerprinter:
    """Fingerprints of named tensors as one (n, 3) int64 tensor per call.

    Why a class: on CUDA every tensor of whole, aligned int64 words goes into one Triton launch
    (`fsdp_sync.bitsums`: the same values as `_sum_fingerprint`, one read of their bits) whose table of addresses is
    kept between calls, so a call's host work is a few integer reads per tensor; results stay on the device. The rest
    (the CPU's CRC-32, odd sizes, unaligned views) is fingerprinted one tensor at a time, as `_fingerprint`.
    """

    def __init__(self) -> None:
        self._sums = bitsums.BitSums(_PERIOD)

    def __call__(self, shards: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
        """The names, in order, and their fingerprints: one row each, on the tensors' device (the CPU if they are on
        several)."""
        names: list[str] = []
        others: list[tuple[int, torch.Tensor]] = []
        rows: list[int] = []
        held: list[torch.Tensor] = []  # alive until the launch: their addresses are in its table
        addresses: list[int] = []
        sizes: list[int] = []
        device: torch.device | None = None
        for name, tensor in shards:
            where = tensor.device
            size = bitsums.words(tensor) if (where == device or device is None) and kernels.usable(where) else None
            if size is None:
                others.append((len(names), tensor))
            else:
                device = where
                rows.append(len(names))
                held.append(tensor)
                addresses.append(tensor.data_ptr())
                sizes.append(size)
            names.append(name)
        if not others:
            if device is None:
                return names, torch.empty(0, 3, dtype=torch.int64)
            return names, self._sums(addresses, sizes, device)
        prints: list[torch.Tensor] = [torch.empty(0)] * len(names)
        for k, tensor in others:
            prints[k] = _fingerprint(tensor)
        if rows:
            for k, row in zip(rows, self._sums(addresses, sizes, device), strict=True):  # type: ignore[arg-type]
                prints[k] = row
        if len({p.device for p in prints}) > 1:
            prints = [p.cpu() for p in prints]
        return names, torch.stack(prints)


def fingerprints(shards: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Fingerprints of each named tensor (one row of three int64 values each), in order (see `Fingerprinter`)."""
    return Fingerprinter()(shards)
