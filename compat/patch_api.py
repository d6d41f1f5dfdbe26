"""Sparse weight patches into a vLLM model, in place: what the installed vLLM offers for it, and which engine weights
can take one.

vLLM 0.32 ships the receiving half (`vllm/model_executor/model_loader/checkpoint_weight_patch.py`,
`load_checkpoint_weight_patches`): a patch in checkpoint names and flat indices becomes a full checkpoint-shaped
tensor whose NaNs mean "unchanged", and goes through the model's own `load_weights` (renaming, fusing, tensor-parallel
slicing) with `Tensor.copy_` made to keep the destination where the source is NaN. Its contract: only plain,
same-shape floating copies (no quantized or repacked layer, no composed loader), and outside the layer-wise reload.
Feature-detected here (`patch_loader`); where it is missing, syncs are dense.

What this module adds around it: which engine parameters honour that contract (`patch_refusals`: unquantized
linear and embedding layers and plain parameters, with their weight present); where each checkpoint tensor lands,
found by running the model's own loader dry (`find_patch_targets`), so that its patches are one indexed write
(`apply_patches`, `EnginePatcher`); and on vLLM-CPU the repack of every GEMM whose weight was patched
(`vllm_patches.repack_cpu_gemms`; the weights must have been kept, `vllm_patches.keep_cpu_linear_weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .engine_api import EngineNaming

__all__ = ["EnginePatch", "EnginePatcher", "PatchTarget", "apply_patches", "find_patch_targets", "patch_loader", "patch_refusals"]

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


def apply_patches(
    model: torch.nn.Module,
    patches: Sequence[EnginePatch],
    naming: EngineNaming,
    targets: dict[str, PatchTarget] | None = None,
) -> list[str]:
    """Write `patches` into the engine model in place, then repack the CPU GEMMs of what was written. Returns the
    engine parameters written.

    Args:
        targets: where checkpoint tensors land (`find_patch_targets`); those patches are written there directly,
            the others through vLLM's `load_checkpoint_weight_patches`.

    Raises:
        RuntimeError: a patch needs vLLM's loader and the installed vLLM has none.
        Whatever vLLM's loader raises (a refused write): the engine may then hold part of the patches (vLLM does not
            roll back); the caller reports it and makes the next sync dense.
    """
    from .vllm_patches import repack_cpu_gemms, unwrap_reload_loaders

    targets = targets or {}
    direct = [p for p in patches if p.name in targets]
    loaded = [p for p in patches if p.name not in targets]
    load = patch_loader()
    if loaded and load is None:
        raise RuntimeError(
            "this vLLM has no load_checkpoint_weight_patches (vllm.model_executor.model_loader."
            "checkpoint_weight_patch, vLLM >= 0.32), so it cannot take sparse syncs; use SyncConfig(sparse=False)"
        )
    written = sorted({targets[p.name].param for p in direct} | {naming.parameter(p.name)[0] for p in loaded})
    params = dict(model.named_parameters(remove_duplicate=False))
    unwrap_reload_loaders(model)
    try:
        with torch.no_grad():
            for p in direct:
                target = targets[p.name]
                flat = params[target.param].data.view(-1)
                flat[p.indices.to(flat.device) + target.offset] = p.values.to(device=flat.device, dtype=flat.dtype)
        if loaded:
            from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

            # NOTE: the indices come from a bitwise diff of disjoint pieces, unique by construction; vLLM's uniqueness
            # check sorts every patch's indices again (validate_unique_indices: "disable only for a trusted producer").
            load(  # type: ignore[misc]
                model,
                [CheckpointWeightPatch(p.name, tuple(p.shape), p.dtype, p.values, p.indices) for p in loaded],
                validate_unique_indices=False,
            )
    finally:
        # Also after a failure part-way: the GEMMs compute from what the weights hold. A tied head shares its
        # embedding's parameter, so it is repacked with it (matched by identity).
        repack_cpu_gemms(model, (params[n] for n in written if n in params))
    return written


class EnginePatcher:
    """Writes patches into one engine model; finds where each checkpoint tensor lands the first time it is patched
    (`find_patch_targets`) and keeps it (parameter names and offsets do not change while the engine lives)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.targets: dict[str, PatchTarget] = {}
        self._probed: set[str] = set()

    @functools.cached_property
    def naming(self) -> EngineNaming:
        from .engine_api import engine_naming

        return engine_naming(self.model)

    def apply(self, patches: Sequence[EnginePatch]) -> list[str]:
        new = {p.name: (tuple(p.shape), p.dtype) for p in patches if p.name not in self._probed}
        if new:
            self.targets.update(find_patch_targets(self.model, new))
            self._probed.update(new)
        return apply_patches(self.model, patches, self.naming, self.targets)
