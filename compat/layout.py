"""Trainer tensor layout -> checkpoint layout, for models whose in-memory weights differ from their checkpoint.

Most models keep one tensor per checkpoint name (identity). transformers 5 fuses some weights at load time (e.g.
mixture-of-experts experts into one 3-D tensor) and reverts that on save; see `TransformersLayout`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from .manifest import PlannedTensor, TensorSpec

__all__ = ["IdentityLayout", "Layout", "TransformersLayout", "layout_for"]


class Layout(Protocol):
    """Plans (from specs) and performs (on tensors) the conversion to checkpoint layout."""

    def plan(
        self, canonical: Mapping[str, tuple[str, TensorSpec]]
    ) -> tuple[list[PlannedTensor], dict[str, str]]:
        """From {trainer name: (canonical name, spec)} to (tensors to push, {trainer name: canonical name})."""
        ...

    def convert(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint tensors for one canonical tensor, in plan order."""
        ...


class IdentityLayout:
    """Checkpoint layout equals the trainer's: one tensor per name, unchanged."""

    def plan(
        self, canonical: Mapping[str, tuple[str, TensorSpec]]
    ) -> tuple[list[PlannedTensor], dict[str, str]]:
        tensors = [PlannedTensor(name, spec, (trainer,)) for trainer, (name, spec) in canonical.items()]
        return tensors, {trainer: name for trainer, (name, _) in canonical.items()}

    def convert(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, tensor),)


class TransformersLayout:
    """Reverts transformers' load-time weight conversions with transformers' own reverse mapping.

    Why: transformers 5 converts some checkpoint layouts when loading (e.g. Qwen3-MoE experts, stored per expert as
    `mlp.experts.{e}.gate_proj.weight`, become one fused `mlp.experts.gate_up_proj` tensor) and reverts them in
    `save_pretrained` through `revert_weight_conversion`. The same function, applied one tensor at a time, gives the
    checkpoint names vLLM's loader expects. Planning runs it on meta tensors, so it costs no memory.

    A conversion whose reverse needs several trainer tensors at once (none among the models tested) shows up at
    planning time as a checkpoint name produced twice, which the manifest check reports.
    """

    def __init__(self, model: object) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self._revert = revert_weight_conversion
        self.model = model
        self._converted: set[str] | None = None

    def plan(
        self, canonical: Mapping[str, tuple[str, TensorSpec]]
    ) -> tuple[list[PlannedTensor], dict[str, str]]:
        tensors: list[PlannedTensor] = []
        targets: dict[str, str] = {}
        self._converted = set()
        for trainer, (name, spec) in canonical.items():
            meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            reverted = self._revert(self.model, {name: meta})
            targets[trainer] = name
            if list(reverted) != [name] or tuple(reverted[name].shape) != tuple(spec.shape):
                self._converted.add(name)
            tensors.extend(
                PlannedTensor(out, TensorSpec(tuple(t.shape), t.dtype), (trainer,)) for out, t in reverted.items()
            )
        return tensors, targets

    def convert(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if self._converted is None:
            raise RuntimeError("TransformersLayout.convert called before plan(); plan once per model structure")
        if name not in self._converted:
            return ((name, tensor),)
        return self._revert(self.model, {name: tensor}).items()


def layout_for(model: object) -> Layout:
    """`TransformersLayout` for a transformers model that has load-time conversions, else `IdentityLayout`.

    Args:
        model: the trainer's model without outer wrappers; PEFT models are looked through to their base model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers < 5 has no load-time conversions
        return IdentityLayout()
    if not isinstance(base, PreTrainedModel):
        return IdentityLayout()
    conversions = getattr(base, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(base, add_legacy=False)
    return TransformersLayout(base) if conversions else IdentityLayout()
