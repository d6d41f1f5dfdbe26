"""Peak extra memory of one sync: measured by the CUDA allocator where there is one, accounted elsewhere.

Why two sources: on CUDA the caching allocator gives an exact high-water mark that can be reset per sync. On CPU
torch keeps no such statistic and the process RSS is shared with the engine and the optimizer, so the sync accounts
for what it holds itself: the full tensors of the unit being gathered plus the copies handed to the engine that the
engine has not released yet (tracked with weak references).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["MemoryMeter"]


class MemoryMeter:
    """High-water mark of the memory a sync adds on top of what the trainer and engine already hold.

    Args:
        device: the device the full tensors live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.source = "cuda_allocator" if self.device.type == "cuda" else "accounted"
        self._held = 0
        self._peak = 0
        self._baseline = 0

    def start(self) -> None:
        """Reset the high-water mark; call once before the sync's first gather."""
        self._held = 0
        self._peak = 0
        if self.source == "cuda_allocator":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)

    def hold(self, nbytes: int) -> None:
        """Account `nbytes` of full tensors that are now alive."""
        self._held += nbytes
        self._peak = max(self._peak, self._held)

    def release(self, nbytes: int) -> None:
        """Account `nbytes` freed."""
        self._held -= nbytes

    def hold_until_freed(self, tensor: torch.Tensor) -> None:
        """Account a tensor until its storage is garbage collected (a copy handed to the engine)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.hold(nbytes)
        weakref.finalize(tensor, self.release, nbytes)

    def peak_extra_bytes(self) -> int:
        """Peak bytes added during the sync: allocator high-water mark on CUDA, accounted peak elsewhere."""
        if self.source == "cuda_allocator":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        return self._peak

    @property
    def accounted_peak_bytes(self) -> int:
        """The accounted peak, available on every device (used to check the accounting against CUDA)."""
        return self._peak
