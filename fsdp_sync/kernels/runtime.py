"""What the kernels share: whether Triton runs for a device, device tables built once per structure, and one
pinned read-back per call.

Why: a kernel over many tensors reads a table of their addresses and sizes. Built with `torch.tensor(rows)` and
copied to the device at every call, that table costs a host-to-device copy and a Python list per tensor; the
addresses of the tensors a sync watches (FSDP's local shards, the snapshot) do not move between syncs, so the table
is kept and rebuilt only when a row changes. Results (a few values per tensor) come back through one pinned buffer:
one copy and one wait per call, not one `.item()` per tensor.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

__all__ = ["HostReadback", "PointerTable", "interpreting", "triton_importable", "usable"]


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`), on CPU tensors: how the unit tests
    run every kernel without a GPU."""
    return triton_importable() and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def usable(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA with Triton, or the CPU under Triton's interpreter.

    NOTE: the CPU path is the interpreter's (slow, exact), taken only where `TRITON_INTERPRET=1` is set, as the tests
    do; every other CPU run takes the torch references.
    """
    if device.type == "cuda":
        return triton_importable()
    return device.type == "cpu" and interpreting()


class PointerTable:
    """An int64 table on one device (columns of addresses, sizes, offsets of many tensors), rebuilt only when its
    content changes.

    Why no reference to the tensors is kept: the table holds numbers only. When the tensors of a later call have the
    same addresses and sizes (checked on every call: the rows are the key), the table describes them exactly, whatever
    became of the tensors it was built from.
    """

    def __init__(self) -> None:
        self._columns: tuple[tuple[int, ...], ...] | None = None
        self._table: torch.Tensor | None = None

    def get(self, columns: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """The table of `columns` (each as long as the number of tensors), flattened column after column."""
        key = tuple(tuple(c) for c in columns)
        if key != self._columns or self._table is None or self._table.device != _indexed(device):
            self._table = torch.tensor(key, dtype=torch.int64).reshape(-1).to(device)
            self._columns = key
        return self._table


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: a tensor's device always has one, so `cuda` must compare as the current `cuda:N`.

    NOTE: compared as given, a table made for `torch.device("cuda")` was rebuilt at every call (found on an H100 by
    `tests/unit/kernels/test_bitsums.py`).
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class HostReadback:
    """Small device results read on the host once per call, through pinned buffers kept between calls."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def read(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of `tensors` (all on one device), after one wait for that device. On CUDA the copies are views
        of pinned buffers that the next `read` overwrites: use them before."""
        if not tensors or tensors[0].device.type != "cuda":
            return list(tensors)
        hosts = []
        for position, tensor in enumerate(tensors):
            if position == len(self._buffers):
                self._buffers.append(torch.empty(0, dtype=tensor.dtype))
            host = self._buffers[position]
            if host.dtype != tensor.dtype or host.numel() != tensor.numel():
                host = self._buffers[position] = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.reshape(-1), non_blocking=True)
            hosts.append(host.view(tensor.shape))
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return hosts
