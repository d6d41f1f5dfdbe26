"""`fsdp-vllm-sync-check`: print how a model's parameters map to engine names under a backend, and every problem.

    fsdp-vllm-sync-check MODEL_DIR [--backend fsdp2|fsdp1|plain] [--lora q_proj,v_proj] [--dtype bfloat16]

Builds the model the way a trainer would (FSDP2 and plain on the meta device, so no weight is read; FSDP1 needs real
storage, so its parameters are allocated uninitialised on the CPU), wraps it on a single-process gloo group, and runs
the same planning and manifest check as a sync, without an engine. Exits 1 if the engine would reject anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

__all__ = ["dry_run", "main"]


def _load(model_dir: str, dtype: torch.dtype, lora: list[str] | None, lora_r: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    # The structure comes from the config alone, on the meta device: no weight is read, and a checkpoint that does
    # not match the model is reported by the check instead of failing the load.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        # NOTE: adapters in the base dtype: FSDP1 flattens a unit's parameters into one tensor of a single dtype.
        config = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=lora)
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    return model


def _unit_classes(model: torch.nn.Module) -> set[type]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _wrap(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    match backend:
        case "plain":
            return model
        case "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (1,))
            classes = tuple(_unit_classes(model))
            for module in list(model.modules()):
                if isinstance(module, classes):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        case "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            model = model.to_empty(device="cpu")
            # to_empty() makes new parameters, which unties tied embeddings; tie them again as loading does.
            (model.get_base_model() if hasattr(model, "get_base_model") else model).tie_weights()
            return FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy(_unit_classes(model)),
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
        case _:
            raise ValueError(f"backend {backend!r}; valid: 'fsdp1', 'fsdp2', 'plain'")


def dry_run(
    model_dir: str,
    backend: str = "fsdp2",
    *,
    dtype: torch.dtype = torch.bfloat16,
    lora: list[str] | None = None,
    lora_r: int = 8,
    out: Any = None,
) -> bool:
    """Print the mapping and the problems; return True when the engine would accept the sync.

    Needs an initialised torch.distributed group for the FSDP backends (`main` makes a single-process one).
    """
    from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
    from fsdp_sync.compat.layout import layout_for
    from fsdp_sync.compat.manifest import ManifestError, check_plan
    from fsdp_sync.compat.names import NameRules

    from .backend import detect_backend, user_model
    from .config import SyncConfig
    from .gather import make_gatherer
    from .peft_merge import PeftMerge
    from .pipeline import build_plan

    out = out or sys.stdout
    model = _wrap(_load(model_dir, dtype, lora, lora_r), backend)
    inner = user_model(model)
    rules = NameRules.for_model(inner)
    detected = detect_backend(model)
    gatherer = make_gatherer(
        model,
        detected,
        SyncConfig(),
        merge_scopes=(PeftMerge.tuner_layer_type(),) if rules.peft else (),
    )
    plan = build_plan(gatherer, rules, layout_for(inner))
    if rules.peft:
        PeftMerge.for_model(inner, rules)  # raises for adapters that cannot be merged as a delta
    print(f"model: {model_dir}\nbackend: {detected.value} ({gatherer.strategy}), dtype {dtype}", file=out)
    print(f"\n{len(plan.tensors)} tensors sent (trainer name -> engine checkpoint name, shape):", file=out)
    for t in plan.tensors:
        source = t.sources[0] if len(t.sources) == 1 else ", ".join(t.sources)
        arrow = "=" if source == t.name else "->"
        print(f"  {source} {arrow} {t.name}  {list(t.spec.shape)}", file=out)
    if plan.dropped:
        print(f"\n{len(plan.dropped)} trainer parameters not sent, on purpose:", file=out)
        for d in plan.dropped:
            print(f"  {d.name}: {d.reason}", file=out)
    try:
        check_plan(plan.tensors, read_checkpoint_manifest(model_dir))
    except ManifestError as e:
        print(f"\nREJECTED: {e}", file=out)
        return False
    print("\nOK: every engine weight is sent exactly once, with the right shape and dtype.", file=out)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-vllm-sync-check", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="local Hugging Face model directory (the one the engine loads)")
    parser.add_argument("--backend", choices=["fsdp1", "fsdp2", "plain"], default="fsdp2")
    parser.add_argument("--lora", default=None, help="comma-separated LoRA target modules, e.g. q_proj,v_proj")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="parameter dtype the trainer uses")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from .testing.dist import free_port

    if args.backend != "plain" and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ok = dry_run(
            args.model_dir,
            args.backend,
            dtype=getattr(torch, args.dtype),
            lora=args.lora.split(",") if args.lora else None,
            lora_r=args.lora_r,
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
