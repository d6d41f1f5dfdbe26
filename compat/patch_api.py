"""Sparse weight patches into a vLLM model, in place: what the installed vLLM offers for it, and which engine weights
can take one.

vLLM 0.32 ships the receiving half (`vllm/model_executor/model_loader/checkpoint_weight_patch.py`,
`load_checkpoint_weight_patches`): a patch in checkpoint names and flat indices becomes a full checkpoint-shaped
tensor whose NaNs mean "unchanged", and goes through the model's own `load_weights` (renaming, fusing, tensor-parallel
slicing) with `Tensor.copy_` made to keep the destination where the source is NaN. Its contract: only plain,
same-shape floating copies (no quantized or repacked layer, no composed loader), and outside the layer-wise reload.
Feature-detected here (`patch_loader`); where it is missing, syncs are dense.

What this module adds around it, reading only: which engine parameters honour that contract (`patch_refusals`:
unquantized linear and embedding layers and plain parameters, with their weight present), and where each checkpoint
tensor lands, found by running the model's own loader dry (`find_patch_targets`), so that its patches are one indexed
write. The write itself is `compat/patch_write.py`, apart from these readers, as `vllm_patches.py` is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch


__all__ = ["EnginePatch", "PatchTarget", "find_patch_targets", "patch_loader", "patch_refusals"]

# The quantization methods whose final write is a plain same-shape copy into the parameter the layer computes from
# (vLLM-CPU's pack aside, which `repack_cpu_gemms` renews). Every other method (fp8, GPTQ, fused experts, ...)
# processes weights after loading, so a patch of its parameters is refused and the tensor goes whole.
_PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


class EnginePatch(NamedTuple):
    """The changed elements of one checkpoint tensor: flat indices into the full tensor and their new values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor
    values: torch.Tensor


def patch_loader() -> Callable[..., set[str]] | None:
    """vLLM's `load_checkpoint_weight_patches`, or None where the installed vLLM has none (before 0.32)."""
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches
    except ImportError:
        return None
    return load_checkpoint_weight_patches


def patch_refusals(model: torch.nn.Module) -> dict[str, str]:
    """Engine parameter name -> why a patch cannot be applied to it in place, for every parameter that cannot take
    one (those not listed can)."""
    refused: dict[str, str] = {}
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        plain = method is None or type(method).__name__ in _PLAIN_METHODS
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if not plain:
                refused[name] = f"its layer processes weights after loading ({type(method).__name__})"
            elif param.numel() == 0:
                refused[name] = "vLLM-CPU packed its weight away (size 0)"
            elif not param.is_floating_point():
                refused[name] = f"not floating point ({param.dtype}); NaN marks unchanged elements"
    return refused


@dataclass(frozen=True)
class PatchTarget:
    """Where a checkpoint tensor lands in the engine: parameter `param`, flat elements `[offset, offset + numel)`
    in checkpoint order."""

    param: str
    offset: int


def find_patch_targets(model: torch.nn.Module, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, PatchTarget]:
    """Where each checkpoint tensor lands, found by the model's own loader run dry (`load_probe.probe_loads`:
    nothing is written, and only this thread's copies are caught). A tensor whose load ends in exactly one copy of
    the whole tensor, unsliced and uncast (or widened exactly, as vLLM-CPU keeps some biases in float32), into a
    contiguous run of one parameter gets a target; the others (tensor-parallel slices, casts, composed loaders) get
    none and are patched through vLLM's loader.

    Why: vLLM's `load_checkpoint_weight_patches` builds a full NaN-filled tensor per patched tensor and writes every
    element of it (`torch.where`): measured 0.41 s for 3% changes of a 150M model on the 2-core CPU machine, more
    than its whole dense reload (0.44 s); an indexed write of the changes alone is O(changes).
    """
    from .load_probe import probe_loads

    targets: dict[str, PatchTarget] = {}
    for name, landing in probe_loads(model, specs, real_sources=True).items():
        copy = landing.single_copy(specs[name][1])
        if copy is not None:
            targets[name] = PatchTarget(copy.param, copy.offset)
    return targets
