"""PEFT adapters merged into the pushed weights, out of place: the trainer's weights are never modified.

Why not `merge_adapter()` / `unmerge_adapter()` as TRL does: under FSDP it merges into shards (measured with FSDP1:
"inconsistent tensor size"), and even where it works, `W + d - d` is not `W` in floating point, so every sync would
drift the trainer's base weights. Here the base weight's full tensor (gathered anyway) gets `+ delta` in a new tensor,
with the delta from PEFT's own `get_delta_weight`, the same function `merge()` uses, so the pushed values equal what
PEFT's merge would produce.

The delta is computed from the adapter weights as the gather delivers them (full tensors, by name), not from the
tuner layer's registered parameters: those are shards under every strategy but the per-unit ones, so any gatherer
can feed the merge, and the merge runs no collective of its own. `get_delta_weight` is PEFT's code, evaluated on a
view of the layer whose adapter containers hold the gathered tensors (`_GatheredLayer`). Which gathered name is
which adapter weight is read from the name (`adapter_weight`), so it holds however the model is wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_sync.compat.names import Dropped, NameRules, canonical_name, unwrapped_name
from .errors import SyncError

__all__ = ["PeftMerge", "UnsupportedAdapterError"]


class UnsupportedAdapterError(SyncError, ValueError):
    """An adapter type whose merge is not a plain additive delta on the base weight. A `SyncError` (every error a sync
    raises is one) and a `ValueError`: raised in a sync, it reaches the caller as itself on the rank that found it."""


@dataclass(frozen=True)
class _Target:
    module: nn.Module
    adapters: tuple[str, ...]
    bias: bool = False  # the base bias receiving `lora_B.bias * scaling` (LoRA with `lora_bias=True`)


class PeftMerge:
    """Adds each tuner layer's active, unmerged adapters to its base weight (and bias, with `lora_bias`) as it
    streams past.

    Build with `PeftMerge.for_model`; `apply(checkpoint_name, full_base_weight, full_adapter_weights)` returns the
    merged tensor; `adapter_weight(name)` says which gathered tensors are adapter weights, and of which targets.
    """

    def __init__(self, targets: dict[str, _Target], layers: dict[str, tuple[str, ...]], rules: NameRules) -> None:
        self._targets = targets
        self._layers = layers  # unwrapped tuner layer path -> the targets it merges into
        self._rules = rules

    @property
    def names(self) -> frozenset[str]:
        """Checkpoint names of the base weights that receive a delta."""
        return frozenset(self._targets)

    def adapter_weight(self, trainer_name: str) -> tuple[tuple[str, ...], str] | None:
        """For a weight of an active adapter of a merged layer: (the targets whose delta reads it, its name inside
        the layer, e.g. `lora_A.default.weight`); None for any other parameter.

        Read from the name, wrapper segments removed (`compat.names.unwrapped_name`), so the gatherer's names and
        the user model's agree however the model is wrapped (an FSDP1 unit around `lora_A.default` included).
        """
        segments = unwrapped_name(trainer_name, self._rules).split(".")
        for k in range(len(segments) - 2, 0, -1):
            targets = self._layers.get(".".join(segments[:k]))
            if targets is None:
                continue
            module = self._targets[targets[0]]
            container, adapter = segments[k], segments[k + 1]
            if container in module.module.adapter_layer_names and adapter in module.adapters:
                return targets, ".".join(segments[k:])
            return None
        return None

    def reads(self, trainer_name: str) -> bool:
        """Whether the merge computes with this parameter: a merge target's base weight or an adapter weight (the
        flat gatherers then gather it in its own dtype; the merged weight is cast to the engine dtype once)."""
        if self.adapter_weight(trainer_name) is not None:
            return True
        name = canonical_name(trainer_name, self._rules)
        return not isinstance(name, Dropped) and name in self._targets

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
        layers: dict[str, tuple[str, ...]] = {}
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
            layer = layers[unwrapped_name(path, rules)] = (name,)
            bias_adapters = tuple(a for a in adapters if getattr(module, "lora_bias", {}).get(a, False))
            if bias_adapters:
                bias_name = canonical_name(f"{path}.base_layer.bias", rules)
                assert not isinstance(bias_name, Dropped)
                targets[bias_name] = _Target(module, bias_adapters, bias=True)
                layers[unwrapped_name(path, rules)] = (*layer, bias_name)
        if unsupported:
            raise UnsupportedAdapterError(
                f"{len(unsupported)} adapter layer(s) cannot be merged as an additive delta: "
                + ", ".join(unsupported)
                + ". Supported: LoRA without DoRA. Merge these adapters into the model before training, or use LoRA."
            )
        return cls(targets, layers, rules)

    @torch.no_grad()
    def apply(self, name: str, base: torch.Tensor, adapter_weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`base + delta` as a new tensor for a merge target; other tensors are returned unchanged.

        Args:
            adapter_weights: the full value of every weight of the target's layer's active adapters, by its name inside
                the layer (`adapter_weight`).
        """
        target = self._targets.get(name)
        if target is None:
            return base
        layer = _GatheredLayer(target.module, adapter_weights)
        merged = base.clone()
        for adapter in target.adapters:
            if target.bias:
                delta = layer.lora_B[adapter].bias * target.module.scaling[adapter]
            else:
                delta = type(target.module).get_delta_weight(layer, adapter)
            # NOTE: in place with type promotion, as PEFT's merge (`weight.data += delta`): one rounding, not two.
            merged += delta
        return merged


class _GatheredLayer:
    """A tuner layer as `get_delta_weight` reads it, with the gathered full adapter weights in its adapter containers
    (`layer.lora_A[adapter].weight`, `layer.lora_embedding_A[adapter]`); every other attribute is the layer's own.

    NOTE: a view, not a swap of the layer's registered parameters: nothing of the trainer's model is modified, so a
    failure part-way leaves nothing to restore. PEFT's `get_delta_weight` methods read the adapter weights only
    through these containers (LoRA Linear, Embedding, Conv, and the MoE ParamWrapper, which calls Linear's).
    """

    def __init__(self, layer: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        containers: dict[str, dict[str, Any]] = {}
        leaves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for relative, tensor in weights.items():
            container, adapter, *leaf = relative.split(".")
            if leaf:
                leaves.setdefault((container, adapter), {})[".".join(leaf)] = tensor
            else:  # a ParameterDict entry (lora_embedding_A[adapter] is the weight itself)
                containers.setdefault(container, {})[adapter] = tensor
        for (container, adapter), held in leaves.items():
            containers.setdefault(container, {})[adapter] = _GatheredModule(getattr(layer, container)[adapter], held)
        self.__dict__.update(containers)
        self.__dict__["_layer"] = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_layer"], name)


class _GatheredModule:
    """An adapter submodule (`lora_A[adapter]`) with its gathered weights; other attributes are its own."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(weights)
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def _has_adapter(module: nn.Module, adapter: str) -> bool:
    return any(adapter in getattr(module, layer_name, {}) for layer_name in module.adapter_layer_names)


def _uses_dora(module: nn.Module, adapters: tuple[str, ...]) -> bool:
    use_dora = getattr(module, "use_dora", {})
    return any(use_dora.get(a, False) for a in adapters)
