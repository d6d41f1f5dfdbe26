"""Patches of vLLM internals: each one works around a measured vLLM behaviour, says which versions need it, and how
to tell when it can go.

Why a module of its own: everything else in `compat/` only reads vLLM; these change what vLLM does (a method wrapped
per layer, a GEMM repacked, a logger filtered). Each is applied when an engine is
opened (`engine_api.engine_handle`, the `gloo` worker) or around a reload, never at import.

- `keep_moe_experts_processed_on_reload`: a reloaded unquantized fused-MoE layer computes from stale packed experts
  (CPU platform). Needed by vLLM 0.31 and 0.32 (measured; CI's legs run MoE there); it steps aside by itself where
  vLLM runs the experts' post-load step on an update. Can go when `tests/e2e/test_engine_reload.py` passes with it
  disabled on every vLLM CI runs.
- `refresh_tied_cpu_gemms`: a tied output head keeps computing logits from the old embedding's GEMM pack (CPU
  platform; the tied head is never reloaded itself). Needed by 0.28-0.32 (vLLM-CPU's `cpu_linear`). Can go when the
  same test (and the logprob check of every end-to-end test) passes with it disabled.
- `keep_cpu_linear_weights`: vLLM-CPU packs each linear layer's weight for its GEMM and drops the plain weight
  (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`), so nothing can be patched in place. Sparse syncs
  keep it (`remove_weight=False`, at twice the memory of the linear weights) and repack what they patch
  (`repack_cpu_gemms`). 0.28-0.32 (every vLLM-CPU with `cpu_linear`); needed as long as that GEMM packs a copy.
- `unwrap_reload_loaders`: after a layer-wise reload, a layer that received nothing gets its kernel tensors back
  with the reload's deferring weight loader still on some of them (measured on vLLM 0.32: the fused `qkv_proj.bias`
  of a layer left out of a delta reload); a later in-place load through it is buffered for a reload that is over,
  and dropped ("Excessive loading"). Sparse patches unwrap them first. Can go when a patch of a layer left out of
  the previous reload lands (`tests/e2e/test_engine_patches.py` is the regression).
- `load_gpt_oss_through_weight_loaders`: vLLM's gpt-oss loader (`GptOssModel._load_weights_other`, the unquantized
  path) copies the attention sinks and whole expert stacks straight into the parameters instead of through their
  weight loaders. The layer-wise reload moves every layer to the meta device and counts what reaches the weight
  loaders, so those copies go nowhere and the layers get their old tensors back: every sync "succeeded" while
  `attn.sinks` and every expert tensor kept their previous values (measured on vLLM 0.32). Each such model gets its
  sinks loaded through the parameter's weight loader and its expert stacks split into the per-expert tensors that
  vLLM's own streamed-expert path loads through the experts' weight loader. Can go when a reload of gpt-oss
  updates those tensors with the patch disabled (`tests/e2e/test_architectures.py`, gpt_oss).
- `keep_mla_kv_b_proj_weights`: on vLLM-CPU (AMX MLA), multi-head latent attention packs the absorbed matrices from
  `kv_b_proj` at load and then frees `kv_b_proj.weight`, so a later in-place reload cannot recompute them ("shape
  '[512, 2, 64]' is invalid for input of size 0", DeepSeek-V2/V3 on vLLM 0.32). Installed before the engine loads,
  it keeps the weight (its memory: one `kv_b_proj` per layer). CPU platform only (other MLA backends keep it). Can go
  when that release is removed or re-done on reload.
- `fix_every_weight_transfer_engine`: the two reload fixes above (`keep_moe_experts_processed_on_reload`,
  `load_gpt_oss_through_weight_loaders`) reach an engine only where this package writes into it: the colocated
  writer and the `gloo` worker. A server on vLLM's own NCCL backend (TRL's async trainer's default) reloaded gpt-oss
  stale. Installed by the plugin in every vLLM process where this package is installed, it wraps vLLM's
  `WeightTransferEngineFactory.create_engine` so that every engine it makes, whatever its backend, applies both
  fixes to its model before each update; the workers then say so (`applied_engine_fixes`, the trainer's question
  `engine_fixes` in `fsdp_sync.transfer.questions`), which the trainer asks before refusing a gpt-oss push over
  NCCL. vLLM 0.28-0.34 (the factory is unchanged there). Can go with the two fixes it carries.
- `quiet_partial_reload`: vLLM's per-layer warnings for layers a delta sync leaves out on purpose. 0.28-0.34 (the
  `reload.layerwise` / `reload.inplace` loggers). Can go when vLLM stops warning for layers given nothing; if the
  loggers are renamed it filters nothing (harmless).

Elsewhere: `compat/lora_patches.py` (serving adapters pushed in memory) and `compat/cpu_lora_base_requests.py`
(vLLM-CPU's LoRA ops applying the adapter to base-model requests batched with adapter requests).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "applied_engine_fixes",
    "fix_every_weight_transfer_engine",
    "keep_cpu_linear_weights",
    "keep_mla_kv_b_proj_weights",
    "load_gpt_oss_through_weight_loaders",
    "unfixed_reload_gaps",
    "keep_moe_experts_processed_on_reload",
    "quiet_partial_reload",
    "refresh_tied_cpu_gemms",
    "repack_cpu_gemms",
    "unwrap_reload_loaders",
]


class _PartialReloadFilter(logging.Filter):
    """Drops vLLM's warnings about weights a reload was not given (expected when a sync sends only what changed)."""

    MESSAGES = ("Failed to load weights", "Following weights were not loaded from checkpoint")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in str(record.msg) for m in self.MESSAGES)


@contextlib.contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """While a reload runs: vLLM's layer-wise reload warns once per layer it received nothing for, and once more
    listing them; a delta sync leaves most layers out on purpose, so those two warnings are dropped (the sync's own
    report says what was skipped)."""
    loggers = [
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"),
        logging.getLogger("vllm.model_executor.model_loader.reload.inplace"),
    ]
    quiet = _PartialReloadFilter()
    for log in loggers:
        log.addFilter(quiet)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(quiet)


def refresh_tied_cpu_gemms(model: torch.nn.Module) -> list[str]:
    """After a reload on vLLM's CPU platform: repack the GEMM of every layer whose weight is tied to another module's
    (the output head tied to the embedding). Returns the modules repacked.

    Why: vLLM-CPU packs each linear layer's weight for its GEMM when the layer is processed (`cpu_linear`, from
    `dispatch_cpu_unquantized_gemm`). A tied head is never loaded itself (its checkpoint name is skipped), so the
    layer-wise reload never processes it: the embedding's new values reach the shared parameter, but the head keeps
    computing logits from the pack of the old ones (measured on vLLM 0.32 with tied Qwen2: first-token logprobs off by
    up to 4 after an embedding update, with every parameter bit-exact). `remove_weight=False`: the weight is the
    embedding's too.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    repacked: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and owners.get(id(weight), 0) > 1:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked.append(name)
    return repacked


def keep_cpu_linear_weights() -> bool:
    """Make vLLM-CPU keep every linear layer's plain weight next to its GEMM pack (call before the engine loads its
    weights; idempotent). Returns whether the patch is (now) installed.

    Why: a sparse sync patches weights in place, and vLLM-CPU drops the plain weight once packed (a size-0
    parameter). Kept, the weights also stay readable (`verify`, the tests' bit-exact check). Costs a second copy of
    the linear weights in engine memory, on the CPU platform only (other platforms never call this function).
    """
    try:
        import vllm.model_executor.layers.utils as layer_utils
    except ImportError:
        return False
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if getattr(original, "_fvs_keeps_weights", False):
        return True

    @functools.wraps(original)
    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    keep._fvs_keeps_weights = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = keep
    return True


def repack_cpu_gemms(model: torch.nn.Module, params: Iterable[torch.Tensor]) -> list[str]:
    """After weights were written in place (a sparse sync) on vLLM's CPU platform: repack the GEMM of every module
    whose weight is one of `params` (by identity, so a tied head is repacked with its embedding). Returns the modules
    repacked; nothing on other platforms (no `cpu_linear`)."""
    touched = {id(p) for p in params}
    repacked: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and id(weight) in touched:
            if weight.numel() == 0:
                raise RuntimeError(
                    f"{name}: its plain weight was packed away, so the patch could not reach its GEMM; "
                    "keep_cpu_linear_weights() must run before the engine loads"
                )
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked.append(name)
    return repacked


def unwrap_reload_loaders(model: torch.nn.Module) -> list[str]:
    """Give every parameter whose weight loader is still vLLM's layer-wise deferring wrapper (`online_process_loader`)
    its own loader back (the wrapper keeps the original as `__wrapped__`). Returns the parameters unwrapped."""
    unwrapped: list[str] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "__name__", "") != "online_process_loader":
            continue
        while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
            loader = loader.__wrapped__
        param.weight_loader = loader
        unwrapped.append(name)
    return unwrapped


def keep_moe_experts_processed_on_reload(model: torch.nn.Module) -> list[str]:
    """Make every reload of a mixture-of-experts layer end in the layout its experts kernel computes with, as the
    first load does. Idempotent; returns the layers changed by this call.

    Why: vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel` runs the experts kernel's own post-load step
    (`FusedMoEExperts.process_weights_after_loading`) only when it builds the kernel, not on a weight update. On the
    CPU platform that step prepacks `w13_weight`/`w2_weight` for `cpu_fused_moe`, so after a reload the experts hold
    plain weights that the kernel reads as packed ones: every engine parameter equals what was sent, and the model
    computes something else (measured on vLLM 0.32 with a tiny Qwen3-MoE: first-token logprobs off by 0.07 after
    reloading unchanged experts, by 1.0 after a change; a fresh engine from the same weights agrees with the trainer).

    What: each such layer's quant method gets an instance wrapper that, on a weight update of a kernel whose experts
    class has a post-load step, runs that step after vLLM's own processing, unless vLLM ran it itself (a fixed
    vLLM) or rebuilt the kernel; the layer-wise reload then copies the result into the kernel's storage. Only the
    unquantized method is wrapped: its update path is the one read here; quantized methods process differently.
    """
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without the modular MoE kernels
        return []
    changed: list[str] = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or "process_weights_after_loading" in vars(method):
            continue
        method.process_weights_after_loading = _experts_step_on_update(method, FusedMoEExperts)
        changed.append(name)
    return changed


def _experts_step_on_update(method: Any, base: type) -> Callable[[torch.nn.Module], None]:
    """`method.process_weights_after_loading`, followed on a weight update by the experts kernel's own step (see
    `keep_moe_experts_processed_on_reload`); `base` is the class whose no-op step means there is none."""
    original = method.process_weights_after_loading  # the bound class method

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        step = getattr(type(experts), "process_weights_after_loading", None)
        if experts is None or step is base.process_weights_after_loading:  # no kernel yet, or no step of its own
            original(layer)
            return
        ran = False
        class_step = experts.process_weights_after_loading

        def counted(target: torch.nn.Module) -> None:
            nonlocal ran
            ran = True
            class_step(target)

        experts.process_weights_after_loading = counted
        try:
            original(layer)
        finally:
            del experts.process_weights_after_loading
        if not ran and getattr(method, "moe_kernel", None) is kernel:
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading


def load_gpt_oss_through_weight_loaders(model: torch.nn.Module) -> list[str]:
    """Make every gpt-oss model inside `model` load its attention sinks and expert stacks through weight loaders, so
    that an in-place reload updates them (see the module docstring). Idempotent; returns the modules changed.

    What: the model's `load_weights` is wrapped per instance. A sinks tensor goes to the parameter's own weight
    loader (the plain copy outside a reload, the reload's deferring loader inside one), narrowed to this
    tensor-parallel rank's heads as vLLM's loader narrows it. An expert stack (`experts.w13_weight`, `w2_weight`,
    `w13_bias`, `w2_bias`: one tensor for all experts) is passed on as one tensor per expert
    (`experts.<e>.w13_weight`), which vLLM's streamed-expert path loads through the fused experts' weight loader with
    the same slicing and transposition as the stacked path. Steps aside on a vLLM without that path.
    """
    changed: list[str] = []
    for name, module in model.named_modules():
        streamed = getattr(type(module), "_get_streamed_expert_info", None)
        if type(module).__name__ != "GptOssModel" or streamed is None or "load_weights" in vars(module):
            continue
        module.load_weights = _gpt_oss_load_weights(module)
        changed.append(name)
    return changed


# The expert stacks of gpt-oss's unquantized checkpoint, by their names after vLLM's renaming (`gate_up_proj` ->
# `w13_weight`, ...): one tensor holds every expert along dim 0.
_GPT_OSS_EXPERT_STACKS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def _gpt_oss_load_weights(module: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]:
    original = module.load_weights  # the bound class method

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= original(_through_weight_loaders(module, weights, loaded))
        return loaded

    return load_weights


def _through_weight_loaders(
    module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights gpt-oss's own loader should see: sinks are loaded here (and recorded in `loaded`), expert stacks
    are split per expert, everything else passes as it is."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params: dict[str, torch.nn.Parameter] | None = None
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "sinks":
            # NOTE: read at each tensor: inside a reload the layer's parameters are replaced (meta, then real).
            params = dict(module.named_parameters())
            param = params[name]
            heads = param.shape[0]
            rank = get_tensor_model_parallel_rank() if get_tensor_model_parallel_world_size() > 1 else 0
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.narrow(0, rank * heads, heads))
            loaded.add(name)
        elif leaf in _GPT_OSS_EXPERT_STACKS and prefix.endswith(".mlp.experts"):
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{leaf}", tensor[expert]
        else:
            yield name, tensor


# The fixes `fix_every_weight_transfer_engine` makes every weight-transfer engine apply, by name.
ENGINE_FIXES = ("keep_moe_experts_processed_on_reload", "load_gpt_oss_through_weight_loaders")
_ENGINES_FIXED = False


def fix_every_weight_transfer_engine() -> bool:
    """Make every weight-transfer engine vLLM's factory builds in this process apply the reload fixes to its model
    before each update (idempotent). Returns whether it is installed; False on a vLLM without the weight-transfer
    API."""
    global _ENGINES_FIXED
    if _ENGINES_FIXED:
        return True
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    create = WeightTransferEngineFactory.__dict__["create_engine"].__func__

    @functools.wraps(create)
    def create_engine(cls: type, config: Any, vllm_config: Any, device: Any, model: torch.nn.Module) -> Any:
        engine = create(cls, config, vllm_config, device, model)
        start = engine.start_weight_update

        def start_weight_update(*args: Any, **kwargs: Any) -> Any:
            fixed = [*keep_moe_experts_processed_on_reload(model), *load_gpt_oss_through_weight_loaders(model)]
            if fixed:
                logger.info("fsdp-vllm-sync: reload fixes applied to %s before the update: %s", config.backend, fixed)
            return start(*args, **kwargs)

        engine.start_weight_update = start_weight_update
        return engine

    WeightTransferEngineFactory.create_engine = classmethod(create_engine)  # type: ignore[method-assign]
    _ENGINES_FIXED = True
    return True


def applied_engine_fixes() -> tuple[str, ...]:
    """The reload fixes every weight-transfer engine of this process applies: `ENGINE_FIXES` once
    `fix_every_weight_transfer_engine` is installed, none before (what a server's workers answer the trainer)."""
    return ENGINE_FIXES if _ENGINES_FIXED else ()


def unfixed_reload_gaps(architectures: Iterable[str], names: Iterable[str]) -> dict[str, str]:
    """Checkpoint name -> why an engine without this module's loader fixes (a server on vLLM's own weight-transfer
    backend) keeps it stale on an in-place update, for the models whose fix is `load_gpt_oss_through_weight_loaders`.

    Why by name: a server's model cannot be run dry from the trainer (`load_probe`); these are the tensors vLLM
    0.28-0.32's gpt-oss loader writes around the layer-wise reload (measured on 0.32, read in 0.28 and 0.31).
    """
    if "GptOssForCausalLM" not in set(architectures):
        return {}
    reason = (
        "vLLM's gpt-oss loader writes it around the in-place reload, so an update keeps the old values; this package "
        "fixes that in every weight-transfer engine of a server it is installed in, and this server did not say it "
        "has the fix: install fsdp-vllm-sync in the server's environment (any backend), or start the server with "
        "--weight-transfer-config '{\"backend\": \"gloo\"}'"
    )
    stacks = tuple(f".mlp.experts.{leaf}" for leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"))
    return {name: reason for name in names if name.endswith(".self_attn.sinks") or name.endswith(stacks)}


def keep_mla_kv_b_proj_weights() -> bool:
    """Make vLLM-CPU's multi-head latent attention keep `kv_b_proj.weight` after packing its absorbed matrices (call
    before the engine loads its weights; idempotent). Returns whether the patch is (now) installed; False where
    this vLLM has no MLA layer class.

    Why: see the module docstring. What: `MLAAttention.process_weights_after_loading` is wrapped (class-wide, as
    the release happens while the engine is built, before any instance can be reached); where it replaced the
    weight by an empty one, the original parameter is put back.
    """
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:
        return False
    original = MLAAttention.process_weights_after_loading
    if getattr(original, "_fvs_keeps_kv_b_proj", False):
        return True

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, act_dtype: torch.dtype) -> None:
        projection = getattr(self, "kv_b_proj", None)
        weight = getattr(projection, "weight", None)
        original(self, act_dtype)
        if (
            isinstance(weight, torch.nn.Parameter)
            and weight.numel() > 0
            and getattr(projection, "weight", None) is not weight
            and projection.weight.numel() == 0
        ):
            projection.weight = weight

    process_weights_after_loading._fvs_keeps_kv_b_proj = True  # type: ignore[attr-defined]
    MLAAttention.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    return True
