"""GPU kernels of the sync and what they share: one launch over many tensors, results read back once.

Why a package: a sync watches or diffs hundreds of tensors, and on a GPU the host work per tensor (a launch, a
table row, a read-back) costs more than the bytes (docs/benchmarks.md). Each kernel here covers every tensor of a
call in one launch through a device table of addresses and sizes that is built once per structure and reused
(`runtime.PointerTable`), and hands its small results to the host through one pinned buffer
(`runtime.HostReadback`). Every kernel has a torch reference that the unit tests compare with bit for bit, on the
CPU under Triton's interpreter (`TRITON_INTERPRET=1`).

Modules: `runtime` (whether Triton runs for a device, tables, read-back), `extract` (sparse extraction).
"""

from __future__ import annotations
