"""The FSDP1 -> FSDP2 migration check: does the engine receive the same weights after `accelerate to-fsdp2`?

    fsdp-vllm-sync-check MODEL_DIR --accelerate-config fsdp1.yaml --compare-fsdp2

Reads the user's accelerate FSDP1 config, converts it with accelerate's own converter (`convert_config_to_fsdp2`,
what `accelerate to-fsdp2` runs) and writes the result next to the original, then wraps the model (built from its
config on the meta device, as the dry run does) the way each config says, plans the sync under both and compares
what the engine would receive: names, shapes, dtypes, and the dtype on the wire during the gather.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

__all__ = [
    "KEY_NOTES",
    "WrapSpec",
    "compare_plans",
    "migration_check",
    "read_accelerate_config",
    "wrap_on_one_rank",
    "wrap_spec",
]

# What each FSDP1 key that `accelerate to-fsdp2` drops or renames means for the weight sync.
KEY_NOTES: dict[str, str] = {
    "fsdp_use_orig_params": "removed: FSDP2 always keeps the original parameters (as DTensors); the sync reads them "
    "by name either way",
    "fsdp_sync_module_states": "removed: FSDP2 has no broadcast of rank 0's weights at wrap time; load the same "
    "weights on every rank (or use fsdp_cpu_ram_efficient_loading)",
    "fsdp_backward_prefetch": "removed: FSDP2 prefetches by itself; no effect on the sync",
    "fsdp_forward_prefetch": "not implemented in FSDP2 (dropped); no effect on the sync",
    "fsdp_sharding_strategy": "becomes fsdp_reshard_after_forward (FULL_SHARD -> true, SHARD_GRAD_OP -> false); no "
    "effect on what the sync sends",
}

_MIXED_PRECISION: dict[str, torch.dtype | None] = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class WrapSpec:
    """What an accelerate FSDP config says about the wrapping, as far as the weight sync can tell.

    Attributes:
        version: 1 or 2.
        unit_classes: class names wrapped as their own units (`fsdp_transformer_layer_cls_to_wrap`), or None for the
            model's `_no_split_modules` (accelerate's default for TRANSFORMER_BASED_WRAP).
        use_orig_params: FSDP1 only.
        param_dtype: the mixed-precision compute dtype (`mixed_precision`), or None.
    """

    version: int
    unit_classes: tuple[str, ...] | None
    use_orig_params: bool
    param_dtype: torch.dtype | None


def read_accelerate_config(path: Path) -> dict[str, Any]:
    """The accelerate config at `path`, as the mapping its YAML holds.

    Raises:
        ValueError: the file cannot be read, is not YAML, or does not hold a mapping (one line, saying where).
    """
    import yaml

    from .cli import joined_lines

    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:  # unreadable, not UTF-8 (a ValueError), malformed YAML
        raise ValueError(f"cannot be read as YAML: {joined_lines(e)}") from e
    if not isinstance(loaded, dict):
        raise ValueError(f"holds a YAML {type(loaded).__name__}, not a mapping of accelerate settings")
    return loaded


def wrap_spec(config: dict[str, Any]) -> WrapSpec:
    """Read the wrapping out of an accelerate config (as loaded from its YAML).

    Raises:
        ValueError: no `fsdp_config`, or an auto-wrap policy the check does not model (only TRANSFORMER_BASED_WRAP).
    """
    fsdp = config.get("fsdp_config")
    if not fsdp:
        raise ValueError("the accelerate config has no fsdp_config section; it does not configure FSDP")
    if not isinstance(fsdp, dict):
        raise ValueError(f"fsdp_config holds a {type(fsdp).__name__}, not a mapping of fsdp_* settings")
    policy = fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ValueError(
            f"fsdp_auto_wrap_policy {policy!r} is not modelled by this check (only TRANSFORMER_BASED_WRAP, one unit "
            "per decoder layer, which TRL's configs use)"
        )
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",") if c.strip()]
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap {classes!r}; give class names, comma-separated or as a list"
        )
    mixed = str(config.get("mixed_precision", "no"))
    if mixed not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision {mixed!r}; valid: {list(_MIXED_PRECISION)}")
    version = fsdp.get("fsdp_version", 1)
    if version not in (1, 2, "1", "2"):
        raise ValueError(f"fsdp_version {version!r}; valid: 1, 2")
    return WrapSpec(
        version=int(version),
        unit_classes=tuple(classes) if classes else None,
        use_orig_params=bool(fsdp.get("fsdp_use_orig_params", True)),
        param_dtype=_MIXED_PRECISION[mixed],
    )


def wrap_on_one_rank(model: nn.Module, spec: WrapSpec) -> nn.Module:
    """Wrap on a single-process group as accelerate would for `spec` (units first, then the root); the dry run and
    this check share it. FSDP2 keeps the meta device; FSDP1 needs real storage (uninitialised CPU memory)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the transformers model
    names = set(spec.unit_classes or getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    missing = names - {c.__name__ for c in classes}
    if missing and spec.unit_classes:
        raise ValueError(f"fsdp_transformer_layer_cls_to_wrap names {sorted(missing)}, which the model does not have")
    if spec.version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=spec.param_dtype)
        for module in list(model.modules()):
            if isinstance(module, tuple(classes)):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = model.to_empty(device="cpu")
    # to_empty() makes new parameters, which unties tied embeddings; tie them again as loading does.
    (model.get_base_model() if hasattr(model, "get_base_model") else model).tie_weights()
    mp = MixedPrecision(param_dtype=spec.param_dtype) if spec.param_dtype is not None else None
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(classes),
        device_id=torch.device("cpu"),
        use_orig_params=spec.use_orig_params,
        mixed_precision=mp,
    )


@dataclass(frozen=True)
class _Planned:
    strategy: str
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, torch.dtype]]  # name -> shape, dtype, wire dtype


def _plan(model_dir: Path, spec: WrapSpec, dtype: torch.dtype, engine_dtype: torch.dtype) -> _Planned:
    from fsdp_sync.compat.layout import layout_for
    from fsdp_sync.compat.names import NameRules

    from .backend import detect_backend, user_model
    from .config import SyncConfig
    from .cli import meta_model
    from .gather import make_gatherer
    from .gather.collectives import gather_dtype
    from .sync.stream import build_plan

    model = wrap_on_one_rank(meta_model(model_dir, dtype), spec)
    inner = user_model(model)
    gatherer = make_gatherer(model, detect_backend(model), SyncConfig(), engine_dtype=engine_dtype)
    plan = build_plan(gatherer, NameRules.for_model(inner), layout_for(inner))
    tensors = {
        t.name: (tuple(t.spec.shape), t.spec.dtype, gather_dtype(t.spec.dtype, engine_dtype)) for t in plan.tensors
    }
    return _Planned(gatherer.strategy, tensors)


def compare_plans(first: dict[str, tuple], second: dict[str, tuple], labels: tuple[str, str]) -> list[str]:
    """Every difference in what the engine would receive (name -> (shape, dtype, wire dtype)), one line each."""
    a, b = labels
    lines = [f"{n}: sent under {a} only" for n in sorted(set(first) - set(second))]
    lines += [f"{n}: sent under {b} only" for n in sorted(set(second) - set(first))]
    fields = ("shape", "dtype", "dtype on the wire during the gather")
    for name in sorted(set(first) & set(second)):
        for field, x, y in zip(fields, first[name], second[name]):
            if x != y:
                lines.append(f"{name}: {field} {x} under {a}, {y} under {b}")
    return lines


def migration_check(
    model_dir: Path, config_path: Path, *, dtype: torch.dtype, engine_dtype: torch.dtype, out: TextIO
) -> bool:
    """Print the conversion and the comparison; return True when the engine would receive the same weights.

    Needs an initialised single-process torch.distributed group (the dry run's `main` makes one).

    Raises:
        ValueError: the config cannot be read, or is not an FSDP1 config this check models, or its conversion cannot
            be written next to it.
    """
    import yaml
    from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2

    original = read_accelerate_config(config_path)
    first = wrap_spec(original)
    if first.version != 1:
        raise ValueError(f"{config_path} already configures FSDP{first.version}; pass the FSDP1 config")
    converted = convert_config_to_fsdp2(copy.deepcopy(original))
    target = config_path.with_name(f"{config_path.stem}-fsdp2{config_path.suffix or '.yaml'}")
    try:
        target.write_text(yaml.safe_dump(converted, sort_keys=False))
    except OSError as e:
        raise ValueError(f"cannot write the converted config to {target}: {e.strerror or e}") from e
    second = wrap_spec(converted)

    print(f"model: {model_dir}\naccelerate config: {config_path}\nconverted with accelerate's to-fsdp2: {target}", file=out)
    old_keys, new_keys = set(original["fsdp_config"]), set(converted["fsdp_config"])
    for key in sorted(old_keys - new_keys):
        print(f"  {key}: {KEY_NOTES.get(key, 'dropped by the converter')}", file=out)
    for key in sorted(new_keys - old_keys):
        print(f"  {key}: added ({converted['fsdp_config'][key]!r})", file=out)

    plans: dict[str, _Planned] = {}
    for label, spec in (("FSDP1", first), ("FSDP2", second)):
        try:
            plans[label] = _plan(model_dir, spec, dtype, engine_dtype)
        except Exception as e:  # noqa: BLE001 - a wrap that fails is the answer for this config
            print(f"\n{label}: the model cannot be wrapped as configured: {type(e).__name__}: {e}", file=out)
    if len(plans) < 2:
        return False
    one, two = plans["FSDP1"], plans["FSDP2"]
    print(
        f"\nFSDP1 ({one.strategy}): {len(one.tensors)} tensors; FSDP2 ({two.strategy}): {len(two.tensors)} tensors; "
        f"engine dtype {engine_dtype}",
        file=out,
    )
    differences = compare_plans(one.tensors, two.tensors, ("FSDP1", "FSDP2"))
    if differences:
        print(f"\nDIFFERENT: {len(differences)} difference(s) in what the engine would receive:", file=out)
        for line in differences:
            print(f"  {line}", file=out)
        if any(line.endswith("sent under FSDP2 only") for line in differences):
            print(
                "  (FSDP2 shards each unit's parameters on their own: a weight tied across two units, e.g. an "
                "embedding wrapped as its own unit and the output head in the root, becomes two parameters that "
                "training moves apart; keep tied modules in one unit)",
                file=out,
            )
        return False
    print("\nSAME PLAN: the engine receives the same names, shapes and dtypes under both configs.", file=out)
    return True
