"""Test-side faults injected from outside the library, through torch and vLLM functions (issue 47): what the
library's own fault points (`fsdp_sync.faults`) cannot show, because the library would be telling itself.

- `BarrierFaults`: this rank's `torch.distributed.monitored_barrier` (the first collective of every agreement of a
  sync) raises at a chosen agreement of a chosen sync, counted from the sync's end: 0 the last (the one that tells
  every rank whether the sync committed), 1 the one before. How many agreements a sync runs is counted in this
  rank's last clean sync of the same shape (not the first, not a retry), never read from the library.
- `corrupt_colocated_adapter`: vLLM's LoRA manager (`LRUCacheLoRAModelManager.add_adapter`) registers adapter id N
  with its `lora_b` changed (+1 on every element of one module): the engine then holds another adapter than was
  sent, as a bad copy would leave it.
- `corrupt_adapter_broadcast`: the adapter's bytes sent to a server are changed on the wire (gloo's
  `ProcessGroupGloo.broadcast`, the trainer's side) in one chosen sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BarrierFaults", "corrupt_adapter_broadcast", "corrupt_colocated_adapter"]


class BarrierFaults:
    """`--barrier-fault SYNC:FROM_END` on this rank (1-based syncs as the job counts them).

    Call `start(sync, shaped)` before each try of a sync and `done(ok)` after it; `shaped`: the try is a later
    sync of the usual shape (not the first, not a retry), whose count of agreements is kept for the next target.
    """

    def __init__(self, specs: list[str], armed_here: bool) -> None:
        import torch.distributed as dist

        self.plan = {int(s): int(e) for s, e in (spec.split(":") for spec in specs)} if armed_here else {}
        self.calls = 0
        self.fail_at: int | None = None
        self.last_clean: int | None = None
        self.shaped = False
        self.fired: list[dict[str, int]] = []
        self._barrier = dist.monitored_barrier
        if self.plan:
            dist.monitored_barrier = self._counted

    def _counted(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            self.fired.append({"call": self.calls})
            self.fail_at = None
            raise RuntimeError(f"injected: this rank's monitored_barrier, call {self.calls} of the sync")
        return self._barrier(*args, **kwargs)

    def start(self, sync: int, *, shaped: bool) -> None:
        self.calls, self.shaped = 0, shaped
        from_end = self.plan.get(sync)
        self.fail_at = None
        if from_end is not None:
            assert self.last_clean is not None, f"--barrier-fault {sync}: no clean sync of the same shape before it"
            self.fail_at = self.last_clean - from_end

    def done(self, ok: bool) -> None:
        if ok and self.shaped:
            self.last_clean = self.calls
        self.fail_at = None


def corrupt_colocated_adapter(adapter_id: int) -> None:
    """The in-process engine's LoRA manager registers adapter `adapter_id` (once) with one module's `lora_b` moved
    by 1 on every element (see the module's docstring)."""
    import torch
    from vllm.lora.model_manager import LRUCacheLoRAModelManager

    original = LRUCacheLoRAModelManager.add_adapter
    fired: list[int] = []

    def add_adapter(self: Any, lora: Any) -> bool:
        if lora.id == adapter_id and not fired:
            fired.append(lora.id)
            for module in sorted(lora.loras):
                b = lora.loras[module].lora_b
                if isinstance(b, torch.Tensor):
                    with torch.no_grad():
                        b.add_(1.0)
                    logger.warning("test-side: adapter %d registered with %s.lora_b changed", adapter_id, module)
                    break
        return original(self, lora)

    LRUCacheLoRAModelManager.add_adapter = add_adapter  # type: ignore[method-assign]


def corrupt_adapter_broadcast(armed: Callable[[], bool]) -> None:
    """The first gloo broadcast this process sends while `armed()` (an adapter sync's only data round) carries its
    data changed: 1 added to every float32 word before the chunk's status trailer."""
    import torch
    import torch.distributed as dist

    original = dist.ProcessGroupGloo.broadcast
    fired: list[bool] = []

    def broadcast(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if armed() and not fired and isinstance(tensors, list) and tensors:
            fired.append(True)
            buffer = tensors[0]
            from fsdp_sync.transfer.gloo_wire import TRAILER

            words = (buffer.numel() - TRAILER) // 4
            if buffer.dtype == torch.uint8 and words > 0:
                buffer[: words * 4].view(torch.float32).add_(1.0)
                logger.warning("test-side: an adapter round's %d data words changed on the wire", words)
        return original(self, tensors, *args, **kwargs)

    dist.ProcessGroupGloo.broadcast = broadcast  # type: ignore[method-assign]
