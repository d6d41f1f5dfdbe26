"""vLLM's LoRA manager, as an adapter sync uses it: what the engine can serve, and an adapter built from tensors in
memory and loaded under a new id (vLLM 0.32's `vllm/lora/`).

Why here: vLLM's public API loads adapters only from a path (`LoRARequest(lora_path=...)`), so an in-memory push
builds the `LoRAModel` itself (`LoRAModel.from_lora_tensors`, the function vLLM's own path loader ends in) and
registers it with the worker's manager (`LRUCacheWorkerLoRAManager._adapter_manager`, a private field: the worker's
`add_lora` takes only a request with a path). A request for an id the manager holds activates it without reading
the path; the path given (`IN_MEMORY_PATH`) names no file, so an adapter evicted from the manager fails loudly
(`LoRAAdapterNotFoundError`) instead of being served from somewhere else.

Names: adapter tensors travel in PEFT's checkpoint names (`base_model.model.<module>.lora_A.weight`, no adapter
name), as PEFT saves them and vLLM parses them (`parse_fine_tuned_lora_name`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ADAPTER_SEGMENTS",
    "IN_MEMORY_PATH",
    "Adapter",
    "EngineLoRA",
    "LoRALimits",
    "adapter_rank",
    "adapter_refusals",
    "adapter_request",
    "adapter_tensor_name",
    "build_lora_model",
    "engine_adapter",
    "engine_lora_limits",
    "engine_lora_of",
    "held_adapter",
    "holds_adapter",
    "load_adapter",
    "remove_adapter",
    "loaded_adapters",
    "lora_model",
    "max_lora_rank_fix",
    "peft_adapter_config",
    "served_lora_tensors",
    "worker_engine_lora",
]

# The LoRA weights an adapter sync sends (PEFT's `lora_A`/`lora_B`; embedding and DoRA weights are refused).
ADAPTER_SEGMENTS: frozenset[str] = frozenset({"lora_A", "lora_B"})
IN_MEMORY_PATH = "fsdp-vllm-sync:in-memory"
# PEFT's segments around the model that vLLM's name parser expects.
_PEFT_ROOT = ("base_model", "model")


@dataclass(frozen=True)
class Adapter:
    """One adapter version as it is pushed.

    Attributes:
        adapter_id: the engine's int id (unique per version: vLLM keys its prefix cache by adapter name, so a new
            version under a new name and id never reuses the previous version's cached blocks).
        name: the adapter's name in the engine.
        tensors: PEFT checkpoint name -> full tensor (`lora_A` and `lora_B` per target module).
        config: PEFT's adapter config as a dict (`LoraConfig.to_dict()`: r, lora_alpha, target_modules, ...).
    """

    adapter_id: int
    name: str
    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]


@dataclass(frozen=True)
class LoRALimits:
    """What the engine can serve as an adapter (None where it was started without LoRA).

    Attributes:
        max_lora_rank: the engine's `max_lora_rank`.
        target_modules: the module names an adapter may target (vLLM's supported modules, packed ones unfolded:
            `qkv_proj` -> `q_proj`, `k_proj`, `v_proj`); None where only the engine knows them (a server: it checks
            them itself before it registers anything, `build_lora_model`).
        dtype: the dtype the engine holds adapter weights in (`lora_dtype`).
    """

    max_lora_rank: int
    target_modules: frozenset[str] | None
    dtype: torch.dtype | None


def adapter_tensor_name(unwrapped: str, adapter_name: str) -> str | None:
    """The PEFT checkpoint name of a LoRA weight from its trainer name without wrapper segments
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); None for anything that is not a LoRA weight
    of `adapter_name`."""
    segments = unwrapped.split(".")
    for i, segment in enumerate(segments[:-1]):
        if segment in ADAPTER_SEGMENTS:
            if segments[i + 1] != adapter_name:
                return None
            rest = segments[:i + 1] + segments[i + 2:]
            return ".".join(rest if tuple(rest[:2]) == _PEFT_ROOT else [*_PEFT_ROOT, *rest])
    return None


def peft_adapter_config(model: Any) -> tuple[str, dict[str, Any]]:
    """(the active adapter's name, its config as a dict) of a PEFT model, or raise ValueError naming what is not a
    single LoRA adapter."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise ValueError(f"{type(model).__name__} is not a PEFT model")
    active = getattr(model, "active_adapter", None)
    names = list(configs)
    if len(names) != 1 or active not in configs:
        raise ValueError(f"an adapter sync pushes one LoRA adapter; the model has {names} (active: {active!r})")
    config = configs[active]
    kind = str(getattr(config, "peft_type", ""))
    if not kind.endswith("LORA"):
        raise ValueError(f"adapter {active!r} is {kind}, not LoRA")
    return active, _plain(config.to_dict())


def _plain(value: Any) -> Any:
    """A config dict with sets as sorted lists and enums as their values (what `adapter_config.json` holds)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)


def adapter_rank(config: Mapping[str, Any]) -> int:
    """The largest rank of a PEFT LoRA config dict (its `r` and its `rank_pattern` values)."""
    return max([int(config.get("r") or 0), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def max_lora_rank_fix(rank: int, *, server: bool | None, enable_lora: bool = False) -> str:
    """The change that lets an engine serve an adapter of `rank`: `max_lora_rank` at the smallest value vLLM accepts
    that holds it (vLLM takes only some values), as a server's flag (`server=True`), an in-process engine's argument
    (False), or both (None: not known which); with `enable_lora`, LoRA switched on too. A rank above every value vLLM
    accepts is said as such (no setting serves it)."""
    from .trl_adapter import lora_rank_for_engine

    try:
        value = lora_rank_for_engine(rank)
    except ValueError as e:
        return str(e)
    except ImportError:  # a vLLM without the list of accepted ranks: the rank itself is the least it needs
        value = rank
    flag = f"{'--enable-lora ' if enable_lora else ''}--max-lora-rank {value}"
    argument = f"{'enable_lora=True, ' if enable_lora else ''}max_lora_rank={value}"
    match server:
        case True:
            return f"restart the server with {flag}"
        case False:
            return f"start the engine with {argument}"
        case None:
            return f"start the engine with {argument} (a server: {flag})"


def adapter_refusals(
    config: Mapping[str, Any], limits: LoRALimits, targeted: Iterable[str], *, server: bool | None = None
) -> list[str]:
    """Why the engine cannot serve this adapter (empty: it can), read before anything is written; each reason says
    the change that fixes it where one does.

    Args:
        config: PEFT's adapter config dict.
        limits: the engine's LoRA limits.
        targeted: the module names (last segment) the adapter's LoRA weights sit on.
        server: the engine is a vLLM server (True), an in-process `vllm.LLM` (False), or not known (None): which
            setting a fix names (`--max-lora-rank N` or `max_lora_rank=N`).
    """
    reasons = _vllm_refusals(config, limits, server)
    if config.get("modules_to_save"):
        reasons.append(
            f"modules_to_save {sorted(config['modules_to_save'])} (full trained copies, not an adapter: drop "
            "modules_to_save from the LoraConfig)"
        )
    unsupported = sorted(set(targeted) - limits.target_modules) if limits.target_modules is not None else []
    if unsupported:
        reasons.append(
            f"target modules {unsupported} are not LoRA modules of this architecture in vLLM "
            f"(supported: {sorted(limits.target_modules)}; drop them from target_modules)"
        )
    return reasons


def _vllm_refusals(config: Mapping[str, Any], limits: LoRALimits, server: bool | None) -> list[str]:
    """vLLM's own checks of an adapter config (`PEFTHelper.validate_legal`: DoRA, LoRA bias, ranks)."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(dict(config))
    reasons = list(helper._validate_features())
    # NOTE: `PEFTHelper.rank_pattern` came after vLLM 0.28 (detected, not compared by version): a vLLM without it
    # reads every module at the adapter's `r`, so per-module ranks are refused there.
    pattern = getattr(helper, "rank_pattern", None)
    if pattern is None and config.get("rank_pattern"):
        reasons.append("per-module ranks (rank_pattern), which this vLLM does not read")
    ranks = [helper.r, *(pattern if pattern is not None else config.get("rank_pattern") or {}).values()]
    if max(ranks) > limits.max_lora_rank:
        engine = {True: "the server's ", False: "the engine's ", None: ""}[server]
        reasons.append(
            f"rank {max(ranks)} is above {engine}max_lora_rank {limits.max_lora_rank}: "
            f"{max_lora_rank_fix(max(ranks), server=server)} to serve it as an adapter"
        )
    if helper.bias != "none":
        reasons.append(f"bias={helper.bias!r} (vLLM serves no adapter bias: bias='none' in the LoraConfig)")
    return reasons


def _worker_lora_manager(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM engine was started without LoRA (enable_lora=True)")
    return manager


def engine_lora_limits(worker: Any, vllm_config: Any) -> LoRALimits | None:
    """The LoRA limits of an engine's worker (in-process engine or a server worker); None without LoRA."""
    lora_config = getattr(vllm_config, "lora_config", None)
    runner = getattr(worker, "model_runner", None)
    if lora_config is None or getattr(runner, "lora_manager", None) is None:
        return None
    dtype = lora_config.lora_dtype
    return LoRALimits(
        lora_config.max_lora_rank,
        _expected_modules(runner.lora_manager._adapter_manager),
        dtype if isinstance(dtype, torch.dtype) else vllm_config.model_config.dtype,
    )


def _expected_modules(manager: Any) -> frozenset[str]:
    """The module names an adapter may target in the engine of a `LoRAModelManager` (packed ones unfolded)."""
    packed = manager.packed_modules_mapping
    targets: set[str] = set()
    for module in manager.supported_lora_modules:
        targets.update(packed.get(module, [module]))
    return frozenset(targets)


@dataclass(frozen=True)
class EngineLoRA:
    """How an engine builds an adapter from its tensors (`LoRAModel.from_lora_tensors`'s engine-side arguments).

    Attributes:
        dtype: the dtype the engine holds adapter weights in (its `lora_dtype`).
        weights_mapper: the engine model's checkpoint-to-vLLM name mapper (`hf_to_vllm_mapper`), None without one.
        skip_prefixes: module prefixes the engine model skips in adapters (`lora_skip_prefixes`), None without.
        vocab_size: the engine's vocabulary size (checked against embedding adapters), None where unknown.
        max_positions: the model's `max_position_embeddings`, None where unknown.
    """

    dtype: torch.dtype
    weights_mapper: Any = None
    skip_prefixes: Any = None
    vocab_size: int | None = None
    max_positions: int | None = None


def engine_lora_of(model: Any, dtype: torch.dtype, *, vocab_size: int | None, max_positions: int | None) -> EngineLoRA:
    """The `EngineLoRA` of a vLLM model (an engine's model object, or its class where the model lives elsewhere)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return EngineLoRA(dtype, mapper, getattr(model, "lora_skip_prefixes", None), vocab_size, max_positions)


def lora_model(adapter: Adapter, engine: EngineLoRA) -> Any:
    """A vLLM `LoRAModel` of `adapter` built as `engine` builds it (vLLM's own `from_lora_tensors`); unchecked, not
    registered, scaling not yet folded. Also the trainer's expectation of what an engine holds (`served_lora_tensors`)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({**adapter.config, "vllm_max_position_embeddings": engine.max_positions})
    # NOTE: copies: vLLM folds the scaling into `lora_b` in place (`LoRALayerWeights.optimize`), and a tensor already
    # on the host in the LoRA dtype is not copied by `from_lora_tensors`: the caller's tensor (in a single process,
    # the trainer's own parameter) would be scaled.
    return LoRAModel.from_lora_tensors(
        lora_model_id=adapter.adapter_id,
        tensors={name: t.detach().clone() for name, t in adapter.tensors.items()},
        peft_helper=helper,
        device="cpu",
        dtype=engine.dtype,
        model_vocab_size=engine.vocab_size,
        weights_mapper=engine.weights_mapper.get_rename_mapper() if engine.weights_mapper is not None else None,
        skip_prefixes=engine.skip_prefixes,
    )


def build_lora_model(manager: Any, adapter: Adapter, *, lora_config: Any, vocab_size: int, max_positions: int | None) -> Any:
    """A vLLM `LoRAModel` of `adapter` for the engine of `manager` (a `LoRAModelManager`), checked as vLLM's own
    path loader checks an adapter (its config, its target modules, `modules_to_save`); nothing is registered.

    Raises:
        ValueError: the engine cannot serve the adapter (the reasons named).
    """
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    PEFTHelper.from_dict({**adapter.config, "vllm_max_position_embeddings": max_positions}).validate_legal(lora_config)
    expected = _expected_modules(manager)
    modules = sorted({parse_fine_tuned_lora_name(n)[0] for n in adapter.tensors})
    unexpected = [m for m in modules if m.rsplit(".", 1)[-1] not in expected]
    if unexpected:
        raise ValueError(f"target modules {unexpected} are not LoRA modules of this engine (supported: {sorted(expected)})")
    engine = engine_lora_of(manager.model, lora_config.lora_dtype, vocab_size=vocab_size, max_positions=max_positions)
    lora = lora_model(adapter, engine)
    manager._validate_modules_to_save(lora)
    return lora


def served_lora_tensors(lora: Any, packed_modules: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """The tensors of a vLLM `LoRAModel` as generation uses them, by target module: `<module>.lora_a`, and
    `<module>.lora_b` with the module's scaling folded in. A module the engine fused (`qkv_proj`) gives its parts
    under their own names (`packed_modules`: a LoRA manager's fused module -> its parts, full names); parts it could
    not name (fused experts) are `<module>[i]`.

    NOTE: vLLM folds the scaling into `lora_b` once, in place, when its manager registers the adapter
    (`LoRALayerWeights.optimize`: the tensor times the float); one not folded yet (a server's kept version no request
    has named, or the trainer's expectation from `lora_model`) is folded here, out of place, with the same arithmetic.
    """
    out: dict[str, torch.Tensor] = {}
    for module, weights in lora.loras.items():
        a, b, scaling = weights.lora_a, weights.lora_b, weights.scaling
        if isinstance(a, list):
            parts = list(packed_modules.get(module, ()))
            if len(parts) != len(a):
                parts = [f"{module}[{i}]" for i in range(len(a))]
            scalings = scaling if isinstance(scaling, list) else [scaling] * len(a)
        else:
            parts, a, b, scalings = [module], [a], [b], [scaling]
        for part, lora_a, lora_b, factor in zip(parts, a, b, scalings, strict=True):
            if lora_a is None:
                continue
            out[f"{part}.lora_a"] = lora_a
            out[f"{part}.lora_b"] = lora_b if factor == 1 else lora_b * factor
    return out


def worker_engine_lora(worker: Any) -> EngineLoRA:
    """How the worker's LoRA manager builds an adapter (an in-process engine's worker, or a server's)."""
    worker_manager = _worker_lora_manager(worker)
    return engine_lora_of(
        worker_manager._adapter_manager.model,
        worker_manager.lora_config.lora_dtype,
        vocab_size=worker_manager.vocab_size,
        max_positions=worker_manager.max_position_embeddings,
    )


def held_adapter(worker: Any, adapter_id: int) -> tuple[Any, Mapping[str, Sequence[str]]]:
    """The `LoRAModel` the worker's LoRA manager holds for `adapter_id`, and the manager's fused modules (for
    `served_lora_tensors`). Raises KeyError when the manager does not hold the id."""
    manager = _worker_lora_manager(worker)._adapter_manager
    lora = manager.get_adapter(adapter_id)
    if lora is None:
        raise KeyError(f"the engine's LoRA manager holds no adapter {adapter_id} (it holds {sorted(manager.list_adapters())})")
    return lora, manager.packed_modules


def load_adapter(worker: Any, adapter: Adapter, *, replace: int | None = None) -> None:
    """Build `adapter` from its tensors and register it with the worker's LoRA manager under its id (beside what it
    holds, within the manager's capacity: its LRU cache evicts the least recently used beyond it), and remove the
    adapter `replace` if given, so that the next request for the new id is served from memory.

    Raises:
        ValueError: vLLM refuses the adapter (its own checks; nothing was registered).
    """
    worker_manager = _worker_lora_manager(worker)
    manager = worker_manager._adapter_manager
    lora = build_lora_model(
        manager,
        adapter,
        lora_config=worker_manager.lora_config,
        vocab_size=worker_manager.vocab_size,
        max_positions=worker_manager.max_position_embeddings,
    )
    if replace is not None:
        manager.remove_adapter(replace)
    manager.remove_adapter(adapter.adapter_id)  # an id loaded before (a retried version) is replaced whole
    manager.add_adapter(lora)


def remove_adapter(worker: Any, adapter_id: int) -> None:
    """Remove `adapter_id` from the worker's LoRA manager (nothing where it holds none)."""
    _worker_lora_manager(worker)._adapter_manager.remove_adapter(adapter_id)


def holds_adapter(worker: Any, adapter_id: int) -> bool:
    """Whether the worker's LoRA manager holds `adapter_id` (registered, servable without a load)."""
    return _worker_lora_manager(worker)._adapter_manager.get_adapter(adapter_id) is not None


def engine_adapter(worker: Any, adapter_id: int) -> dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]:
    """What the worker's LoRA manager holds for `adapter_id`: engine module -> (lora_a per packed part, lora_b per
    packed part), as vLLM keeps them (`lora_b` with the adapter's scaling folded in: `LoRALayerWeights.optimize`).
    For tests and checks; raises KeyError when the manager does not hold the id."""
    lora, _ = held_adapter(worker, adapter_id)
    out = {}
    for module, weights in lora.loras.items():
        a, b = weights.lora_a, weights.lora_b
        out[module] = (list(a) if isinstance(a, list) else [a], list(b) if isinstance(b, list) else [b])
    return out


def loaded_adapters(worker: Any) -> list[int]:
    """The adapter ids the worker's LoRA manager holds."""
    return sorted(_worker_lora_manager(worker)._adapter_manager.list_adapters())


def adapter_request(adapter_id: int, name: str) -> Any:
    """The `LoRARequest` that asks the engine for an adapter loaded by `load_adapter`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path=f"{IN_MEMORY_PATH}/{name}")
