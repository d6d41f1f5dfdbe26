"""PEFT adapters merged into the pushed weights, out of place: the trainer's weights are never modified.

Why not `merge_adapter()` / `unmerge_adapter()` as TRL does: under FSDP it merges into shards (measured with FSDP1:
"inconsistent tensor size"), and even where it works, `W + d - d` is not `W` in floating point, so every sync would
drift the trainer's base weights. Here the base weight's full tensor (gathered anyway) gets `+ delta` in a new tensor,
with the delta from PEFT's own `get_delta_weight`, the same function `merge()` uses, so the pushed values equal what
PEFT's merge would produce.

The delta must be computed while the layer's adapter weights are full: the gatherers keep units nested inside a
tuner layer full together with their enclosing unit (`merge_scopes`); a delta that is still a DTensor (FSDP2 per
parameter) is all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_sync.compat.names import Dropped, NameRules, canonical_name

__all__ = ["PeftMerge", "UnsupportedAdapterError"]


class UnsupportedAdapterError(ValueError):
    """An adapter type whose merge is not a plain additive delta on the base weight."""


@dataclass(frozen=True)
class _Target:
    module: nn.Module
    adapters: tuple[str, ...]
    bias: bool = False  # the base bias receiving `lora_B.bias * scaling` (LoRA with `lora_bias=True`)


class PeftMerge:
    """Adds each tuner layer's active, unmerged adapters to its base weight (and bias, with `lora_bias`) as it
    streams past.

    Build with `PeftMerge.for_model`; `apply(checkpoint_name, full_base_weight)` returns the merged tensor.
    """

    def __init__(self, targets: dict[str, _Target]) -> None:
        self._targets = targets

    @property
    def names(self) -> frozenset[str]:
        """Checkpoint names of the base weights that receive a delta."""
        return frozenset(self._targets)

    @staticmethod
    def tuner_layer_type() -> type:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return BaseTunerLayer

    @classmethod
    def for_model(cls, model: nn.Module, rules: NameRules) -> PeftMerge:
        """Find every tuner layer with active adapters not already merged.

        Raises:
            UnsupportedAdapterError: listing every layer whose adapter is not an additive delta (DoRA, IA3, ...).
        """
        tuner = cls.tuner_layer_type()
        targets: dict[str, _Target] = {}
        unsupported: list[str] = []
        for path, module in model.named_modules():
            if not isinstance(module, tuner) or module.disable_adapters:
                continue
            adapters = tuple(
                a for a in module.active_adapters if a not in module.merged_adapters and _has_adapter(module, a)
            )
            if not adapters:
                continue
            if not hasattr(module, "get_delta_weight") or _uses_dora(module, adapters):
                unsupported.append(f"{path} ({type(module).__name__})")
                continue
            name = canonical_name(f"{path}.base_layer.weight", rules)
            if isinstance(name, Dropped):
                continue
            targets[name] = _Target(module, adapters)
            bias_adapters = tuple(a for a in adapters if getattr(module, "lora_bias", {}).get(a, False))
            if bias_adapters:
                bias_name = canonical_name(f"{path}.base_layer.bias", rules)
                assert not isinstance(bias_name, Dropped)
                targets[bias_name] = _Target(module, bias_adapters, bias=True)
        if unsupported:
            raise UnsupportedAdapterError(
                f"{len(unsupported)} adapter layer(s) cannot be merged as an additive delta: "
                + ", ".join(unsupported)
                + ". Supported: LoRA without DoRA. Merge these adapters into the model before training, or use LoRA."
            )
        return cls(targets)

    @torch.no_grad()
    def apply(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """`base + delta` as a new tensor for a merge target; other tensors are returned unchanged."""
        target = self._targets.get(name)
        if target is None:
            return base
        merged = base.clone()
        for adapter in target.adapters:
            if target.bias:
                delta = target.module.lora_B[adapter].bias * target.module.scaling[adapter]
            else:
                delta = target.module.get_delta_weight(adapter)
            if isinstance(delta, DTensor):
                delta = delta.full_tensor()
            # NOTE: in place with type promotion, as PEFT's merge (`weight.data += delta`): one rounding, not two.
            merged += delta
        return merged


def _has_adapter(module: nn.Module, adapter: str) -> bool:
    return any(adapter in getattr(module, layer_name, {}) for layer_name in module.adapter_layer_names)


def _uses_dora(module: nn.Module, adapters: tuple[str, ...]) -> bool:
    use_dora = getattr(module, "use_dora", {})
    return any(use_dora.get(a, False) for a in adapters)
