"""One seam per TRL trainer family whose sync is more than one call: what the mixin does differently for it, picked
once per trainer class (`seam_for`). GRPO/RLOO's `vllm_generation.sync_weights` and `_move_model_to_vllm` need
none (`TrainerSeam`, the default, changes nothing); TRL's async trainer has `async_grpo.AsyncGRPOSeam`."""

from __future__ import annotations

from fsdp_sync.compat.trl_api import is_async_trainer

from .base import TrainerSeam, WriterOptions

__all__ = ["TrainerSeam", "WriterOptions", "seam_for"]


def seam_for(trainer_cls: type, mixin: type | None = None) -> TrainerSeam:
    """The seam of `trainer_cls` (built on the sync mixin `mixin`), decided once."""
    if is_async_trainer(trainer_cls, mixin):
        from .async_grpo import AsyncGRPOSeam

        return AsyncGRPOSeam(trainer_cls.__name__)
    return TrainerSeam()
