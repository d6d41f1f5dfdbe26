"""User-facing options of the sync, validated once."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncConfig"]

_FSDP1 = ("unit", "root", "flat")
_FSDP2 = ("unit", "param", "flat")


@dataclass(frozen=True)
class SyncConfig:
    """How weights are gathered and pushed.

    Attributes:
        fsdp1_strategy: `"unit"`: one FSDP unit full at a time (`summon_full_params(unit, recurse=False)`, parents
            first); peak memory is the largest unit. `"root"`: one `summon_full_params(root, recurse=True)`; peak
            memory is the whole model on every rank. `"flat"`: one all-gather per unit of its flat shard, cast to the
            engine dtype first, the next unit's gather overlapping the current push; peak two units in the engine
            dtype.
        fsdp2_strategy: `"unit"`: one grouped all-gather per FSDP unit (`unshard()`); `"param"`: one
            `full_tensor()` per parameter; `"flat"`: as FSDP1's, from the units' local shards.
        PEFT models use `"unit"` where `"flat"` is configured (the adapter merge needs the modules' full views).
        check_manifest: check names, shapes and dtypes against the engine's checkpoint before the first push.
        checkpoint_dir: the checkpoint the engine was started from, when it is not the engine's model path.
        log_metrics: add the sync figures to the trainer's logged metrics.
    """

    fsdp1_strategy: str = "unit"
    fsdp2_strategy: str = "unit"
    check_manifest: bool = True
    checkpoint_dir: str | None = None
    log_metrics: bool = True

    def __post_init__(self) -> None:
        if self.fsdp1_strategy not in _FSDP1:
            raise ValueError(f"fsdp1_strategy={self.fsdp1_strategy!r}; valid: {list(_FSDP1)}")
        if self.fsdp2_strategy not in _FSDP2:
            raise ValueError(f"fsdp2_strategy={self.fsdp2_strategy!r}; valid: {list(_FSDP2)}")
