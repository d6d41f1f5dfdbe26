"""Make accelerate's real FSDP1/FSDP2 path run on CPU processes (gloo), for tests and the demo.

Why: accelerate 1.15 with `use_cpu: true` and an FSDP config silently trains with DDP, because its FSDP path exists only
for accelerator device types. Three test-side changes make the real wrappers appear (measured, see
`../shared/ENVIRONMENT.md` in the dev notes and the README): keep the FSDP plugin and distributed type when the state
resolves to MULTI_CPU; set the type again after the trainer is built; give FSDP1 exactly `torch.device("cpu")` as
`device_id`. None of this is needed, or active, on GPUs. Callers must still assert the wrapper type.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["enable_real_fsdp_on_cpu", "restore_fsdp_distributed_type"]

_ENABLED = False


def enable_real_fsdp_on_cpu() -> None:
    """Patch accelerate and FSDP1 so that an FSDP accelerate config on CPU gives real FSDP wrappers. Idempotent."""
    global _ENABLED
    if _ENABLED:
        return
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FullyShardedDataParallel

    state_init = AcceleratorState.__init__

    @functools.wraps(state_init)
    def _state_init(self, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = _state_init

    fsdp1_init = FullyShardedDataParallel.__init__

    @functools.wraps(fsdp1_init)
    def _fsdp1_init(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        device_id = kwargs.get("device_id")
        if device_id is not None and torch.device(device_id).type == "cpu":
            # NOTE: FSDP1 compares `device_id` with its compute device `cpu`; accelerate passes `cpu:0`-like values.
            kwargs["device_id"] = torch.device("cpu")
        fsdp1_init(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = _fsdp1_init
    _ENABLED = True


def restore_fsdp_distributed_type(trainer: Any) -> None:
    """Set the trainer's accelerator back to FSDP after construction (it reverts to MULTI_CPU on CPU)."""
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    if getattr(state, "fsdp_plugin", None) is not None:
        state.distributed_type = DistributedType.FSDP
