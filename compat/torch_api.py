"""torch internals read by the gatherers, across torch versions, detected by feature in one place.

FSDP2 exposes no public getter for a unit's mixed-precision policy; its state holds it on the parameter group(s):
torch 2.4-2.11 keep one `_fsdp_param_group` (or None), torch 2.12+ a list `_fsdp_param_groups`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["fsdp2_param_groups"]


def fsdp2_param_groups(unit: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one `fully_shard` unit (empty when it manages no parameters)."""
    state = unit._get_fsdp_state()  # type: ignore[attr-defined]
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []
