"""`fsdp-vllm-sync-check`: print how a model's parameters map to engine names under a backend, and every problem.

    fsdp-vllm-sync-check MODEL_DIR [--backend fsdp2|fsdp1|plain] [--lora q_proj,v_proj] [--dtype bfloat16]
    fsdp-vllm-sync-check MODEL_DIR --lora q_proj,v_proj --lora-r 16 --adapter [--max-lora-rank 16]
    fsdp-vllm-sync-check MODEL_DIR --accelerate-config fsdp1.yaml --compare-fsdp2   (fsdp_sync.migration)

Builds the model the way a trainer would (FSDP2 and plain on the meta device, so no weight is read; FSDP1 needs real
storage, so its parameters are allocated uninitialised on the CPU), wraps it on a single-process gloo group, and runs
the same planning and manifest check as a sync, without an engine. With `--adapter`, also what an adapter sync
(`SyncConfig(adapter=True)`) would refuse before anything is sent (`sync.adapter.adapter_refusal`'s checks that need
no engine). Exits 1 if the engine would reject anything, 2 for a plain mistake in the input or any input it cannot
read (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .cli import EXIT_FAILED, EXIT_OK, UsageError, first_line, make_parser, meta_model, positive_int, require, run

__all__ = ["DTYPES", "adapter_check", "build_parser", "dry_run", "main"]

COMMAND = "fsdp-vllm-sync-check"

# The dtypes vLLM's engines compute in; the trainer's parameters are cast to the engine's dtype before a push.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

DESCRIPTION = """\
Check, before training, that every parameter of a model maps to a weight the vLLM engine accepts.

Builds the model from MODEL_DIR/config.json as a trainer would (on the meta device; FSDP1 gets uninitialised CPU
memory), wraps it with the backend on a one-process group, and runs the same planning and manifest check as a sync,
against the checkpoint headers in MODEL_DIR. Prints every trainer name with the engine name it becomes, every
parameter not sent on purpose, and every name the engine would reject. With --adapter, also what an adapter sync
(SyncConfig(adapter=True)) of the --lora adapter would refuse, and the engine's LoRA settings it needs."""

EPILOG = """\
exit codes:
  0  the engine would accept the sync (with --adapter: the adapter sync too)
  1  the engine would reject it (the offending names are printed; with --adapter, or the adapter sync's refusal)
  2  a mistake in the arguments, any input it cannot read or use (the model directory, its config.json or
     weights, the accelerate config), or a missing optional dependency (one line on stderr)"""


def _model_dir(path_or_id: str) -> Path:
    """The local checkpoint directory of `path_or_id` (a directory, or a hub id already in the local cache).

    Raises:
        UsageError: neither exists, or the directory has no `config.json`, or it is not a JSON object.
    """
    from fsdp_sync.compat.checkpoint import resolve_checkpoint_dir

    try:
        directory = resolve_checkpoint_dir(path_or_id)
    except FileNotFoundError as e:
        raise UsageError(
            f"model directory {path_or_id!r} does not exist (nor is it a model in the local Hugging Face cache); "
            "pass the directory the engine loads (config.json and its *.safetensors)"
        ) from e
    config = directory / "config.json"
    if not config.is_file():
        raise UsageError(f"{directory} has no config.json; pass the Hugging Face model directory the engine loads")
    # NOTE: read here, once, for both checks: the manifest and the model both read it, and neither says which file
    # was malformed.
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise UsageError(f"{config} cannot be read as JSON: {first_line(e)}") from e
    if not isinstance(loaded, dict):
        raise UsageError(f"{config} holds a JSON {type(loaded).__name__}, not an object of model settings")
    return directory


def _add_lora(model: torch.nn.Module, targets: list[str], r: int) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters on `targets`, as a PEFT trainer would.

    Raises:
        UsageError: a target names no module of the model (PEFT silently skips it when another one matches), or PEFT
            cannot adapt the modules named.
    """
    from peft import LoraConfig, get_peft_model

    # NOTE: the rule PEFT applies to a list of targets: a module matches if its name is the target or ends with it.
    matched = {t: [m for n, m in model.named_modules() if n == t or n.endswith(f".{t}")] for t in targets}
    linear = ", ".join(
        sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    )
    unknown = [t for t, modules in matched.items() if not modules]
    if unknown:
        raise UsageError(
            f"--lora {','.join(unknown)}: no module of that name in {type(model).__name__}; its linear layers are "
            f"{linear}"
        )
    # NOTE: adapters in the base dtype: FSDP1 flattens a unit's parameters into one tensor of a single dtype.
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets)
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as e:  # a target that is a block of layers (e.g. `mlp`), not a layer PEFT can adapt
        blocks = {type(m).__name__ for ms in matched.values() for m in ms if next(m.children(), None) is not None}
        raise UsageError(
            f"--lora {','.join(targets)}: PEFT cannot adapt {', '.join(sorted(blocks)) or 'these modules'}; name "
            f"layers, e.g. {linear}"
        ) from e


def _wrap(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """Wrap as a trainer would: one unit per `_no_split_modules` class, then the root (`migration.wrap_on_one_rank`)."""
    from .migration import WrapSpec, wrap_on_one_rank

    match backend:
        case "plain":
            return model
        case "fsdp1" | "fsdp2":
            version = 1 if backend == "fsdp1" else 2
            return wrap_on_one_rank(model, WrapSpec(version, None, use_orig_params=True, param_dtype=None))
        case _:
            raise ValueError(f"backend {backend!r}; valid: 'fsdp1', 'fsdp2', 'plain'")


def adapter_check(model: torch.nn.Module, *, max_lora_rank: int | None, out: Any = None) -> bool:
    """Print what an adapter sync (`SyncConfig(adapter=True)`) of `model` (wrapped as the trainer wraps it) would
    send, and every reason it would be refused before anything is sent; return True where it would not be.

    The checks are `sync.adapter.adapter_refusal`'s that need no engine: the PEFT config (one LoRA adapter; vLLM's
    own checks: DoRA, bias, ranks), weights other than `lora_A`/`lora_B`, trainable parameters outside the adapter,
    and the adapter's rank against `max_lora_rank` (None: not checked; the setting the engine needs is printed). Left
    to the first sync: the target modules (the engine knows which it supports) and the engine's base checkpoint
    compared with the trainer's frozen base.
    """
    from fsdp_sync.compat.lora_api import (
        LoRALimits,
        adapter_rank,
        adapter_refusals,
        max_lora_rank_fix,
        peft_adapter_config,
    )
    from fsdp_sync.compat.names import NameRules

    from .backend import detect_backend, user_model
    from .config import SyncConfig
    from .gather import make_gatherer
    from .sync.adapter import FALLBACK, adapter_plan

    out = out or sys.stdout
    inner = user_model(model)
    rules = NameRules.for_model(inner)
    print("\nadapter sync (SyncConfig(adapter=True)):", file=out)
    if not rules.peft:
        reasons = ["the model has no PEFT adapter"]
    else:
        # NOTE: the gatherer an adapter sync builds (`assemble._adapter_sync`): no PEFT merge scopes.
        gatherer = make_gatherer(model, detect_backend(model), SyncConfig(adapter=True))
        reasons = []
        targeted: set[str] = set()
        try:
            plan = adapter_plan(inner, gatherer, rules)
        except ValueError as e:
            reasons.append(str(e))
        else:
            specs = gatherer.specs()
            targeted = {name.split(".")[-3] for name in plan.checkpoint.values()}
            print(f"{len(plan.names)} adapter tensors sent (trainer name -> PEFT checkpoint name, shape):", file=out)
            for name in plan.names:
                print(f"  {name} -> {plan.checkpoint[name]}  {list(specs[name].shape)}", file=out)
        try:
            _, config = peft_adapter_config(inner)
        except ValueError as e:
            reasons.insert(0, str(e))
        else:
            rank = adapter_rank(config)
            limits = LoRALimits(max_lora_rank if max_lora_rank is not None else rank, None, None)
            reasons = adapter_refusals(config, limits, targeted) + reasons
            needs = max_lora_rank_fix(rank, server=None, enable_lora=True)
            print(f"LoRA settings the engine needs (adapter rank {rank}): {needs}", file=out)
    if reasons:
        print(f"\nREFUSED (adapter sync): {'; '.join(reasons)}; {FALLBACK}.", file=out)
        return False
    print(
        "\nOK: an adapter sync would send this adapter (the engine checks its target modules, and the first sync "
        "compares the engine's base with the trainer's).",
        file=out,
    )
    return True


def dry_run(
    model_dir: str,
    backend: str = "fsdp2",
    *,
    dtype: torch.dtype = torch.bfloat16,
    lora: list[str] | None = None,
    lora_r: int = 8,
    adapter: bool = False,
    max_lora_rank: int | None = None,
    out: Any = None,
) -> bool:
    """Print the mapping and the problems; return True when the engine would accept the sync (with `adapter`, the
    adapter sync too: `adapter_check`, rank against `max_lora_rank`).

    Needs an initialised torch.distributed group for the FSDP backends (`main` makes a single-process one).

    Raises:
        UsageError: the model directory, its config or its weights are missing, or a LoRA target does not exist.
    """
    from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
    from fsdp_sync.compat.layout import layout_for
    from fsdp_sync.compat.manifest import ManifestError, check_plan
    from fsdp_sync.compat.names import NameRules

    from .backend import detect_backend, user_model
    from .config import SyncConfig
    from .gather import make_gatherer
    from .peft_merge import PeftMerge
    from .sync.stream import build_plan

    out = out or sys.stdout
    directory = _model_dir(model_dir)
    # NOTE: the manifest (checkpoint headers only, no tensor data) is read before the model is built, so a
    # directory without weights is reported before anything is printed.
    try:
        manifest = read_checkpoint_manifest(directory)
    except FileNotFoundError as e:
        raise UsageError(f"{e}; the check compares the trainer's names with the weights the engine loads") from e
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt weights file is the user's input, not a bug here
        raise UsageError(
            f"cannot read the weight files' headers in {directory}: {type(e).__name__}: {first_line(e)}; "
            "pass the directory the engine loads, with complete *.safetensors (or *.bin) files"
        ) from e
    model = meta_model(directory, dtype)
    if lora:
        model = _add_lora(model, lora, lora_r)
    model = _wrap(model, backend)
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
        check_plan(plan.tensors, manifest)
    except ManifestError as e:
        print(f"\nREJECTED: {e}", file=out)
        accepted = False
    else:
        print("\nOK: every engine weight is sent exactly once, with the right shape and dtype.", file=out)
        accepted = True
    if adapter:
        accepted = adapter_check(model, max_lora_rank=max_lora_rank, out=out) and accepted
    return accepted


def _module_names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty module name in {value!r}; separate names by commas: q_proj,v_proj")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line of `fsdp-vllm-sync-check`."""
    parser = make_parser(COMMAND, DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        help="the Hugging Face model directory the engine loads (config.json and *.safetensors), or a hub id "
        "already in the local cache",
    )
    parser.add_argument(
        "--backend", choices=["fsdp2", "fsdp1", "plain"], default="fsdp2", help="how the trainer wraps the model"
    )
    parser.add_argument(
        "--lora",
        type=_module_names,
        default=None,
        metavar="NAMES",
        help="comma-separated LoRA target modules, e.g. q_proj,v_proj (needs the peft extra)",
    )
    parser.add_argument("--lora-r", type=positive_int, default=8, metavar="R", help="LoRA rank, with --lora")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="with --lora: also check what an adapter sync (SyncConfig(adapter=True)) would refuse, and print the "
        "engine's LoRA settings it needs",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --adapter: the engine's max_lora_rank (a server's --max-lora-rank) to check the adapter's rank "
        "against",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="bfloat16", help="the dtype of the trainer's parameters"
    )
    parser.add_argument(
        "--accelerate-config",
        type=Path,
        default=None,
        metavar="YAML",
        help="with --compare-fsdp2: the accelerate FSDP1 config the trainer runs with",
    )
    parser.add_argument(
        "--compare-fsdp2",
        action="store_true",
        help="convert --accelerate-config with accelerate's to-fsdp2 (written next to it) and check that the "
        "engine receives the same weights under both",
    )
    parser.add_argument(
        "--engine-dtype", choices=list(DTYPES), default="bfloat16", help="with --compare-fsdp2: the engine's dtype"
    )
    return parser


def _compare_fsdp2(args: argparse.Namespace) -> bool:
    from .migration import migration_check

    if args.accelerate_config is None:
        raise UsageError("--compare-fsdp2 needs --accelerate-config YAML (the FSDP1 config to convert)")
    if not args.accelerate_config.is_file():
        raise UsageError(f"--accelerate-config {args.accelerate_config}: no such file")
    # NOTE: the model directory first, the model built once from it: its mistakes are the user's input and end in
    # one line, where a wrap that fails under one config is the comparison's answer (exit 1).
    model_dir = _model_dir(args.model_dir)
    meta_model(model_dir, DTYPES[args.dtype])
    try:
        return migration_check(
            model_dir,
            args.accelerate_config,
            dtype=DTYPES[args.dtype],
            engine_dtype=DTYPES[args.engine_dtype],
            out=sys.stdout,
        )
    except ValueError as e:
        raise UsageError(f"--accelerate-config {args.accelerate_config}: {e}") from e


def _check_max_lora_rank(value: int) -> None:
    """Refuse a `--max-lora-rank` that no vLLM engine could be started with (vLLM takes only some values).

    Raises:
        UsageError: naming the nearest value vLLM accepts.
    """
    from fsdp_sync.compat.trl_adapter import lora_rank_for_engine

    try:
        accepted = lora_rank_for_engine(value)
    except ImportError:  # a vLLM without the list of accepted values: nothing to compare with
        return
    except ValueError as e:
        raise UsageError(f"--max-lora-rank {value}: {e}") from e
    if accepted != value:
        raise UsageError(f"--max-lora-rank {value}: vLLM does not accept it (the next value up is {accepted})")


def _check(args: argparse.Namespace) -> int:
    require(
        {
            "transformers": "trl",
            **({"peft": "peft"} if args.lora else {}),
            **({"vllm": "vllm"} if args.adapter else {}),
            **({"accelerate": "trl", "yaml": "trl"} if args.compare_fsdp2 else {}),
        }
    )
    if args.max_lora_rank is not None:
        _check_max_lora_rank(args.max_lora_rank)

    import torch.distributed as dist

    from .distributed import free_port

    if (args.backend != "plain" or args.compare_fsdp2) and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        if args.compare_fsdp2:
            ok = _compare_fsdp2(args)
        else:
            ok = dry_run(
                args.model_dir,
                args.backend,
                dtype=DTYPES[args.dtype],
                lora=args.lora,
                lora_r=args.lora_r,
                adapter=args.adapter,
                max_lora_rank=args.max_lora_rank,
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_OK if ok else EXIT_FAILED


# Options one mode reads and the other ignores: given to the other mode, each is refused rather than ignored.
_CHECK_ONLY = ("backend", "lora", "lora_r", "adapter", "max_lora_rank")
_COMPARE_ONLY = ("accelerate_config", "engine_dtype")


def _given(argv: list[str] | None, args: argparse.Namespace) -> set[str]:
    """The destinations of the options the command line gives (an option left at its default is not given)."""
    # NOTE: argparse fills in a default only where the namespace it parses into has no such attribute yet.
    unset = object()
    parsed = build_parser().parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset)))
    return {dest for dest, value in vars(parsed).items() if value is not unset}


def _refuse_ignored(args: argparse.Namespace, given: set[str]) -> None:
    """Refuse an option the chosen mode would ignore without a word.

    Raises:
        UsageError: naming the option and the option it needs (or the mode that does not read it).
    """
    option = {dest: "--" + dest.replace("_", "-") for dest in (*_CHECK_ONLY, *_COMPARE_ONLY)}
    if args.compare_fsdp2:
        for dest in _CHECK_ONLY:
            if dest in given:
                raise UsageError(
                    f"{option[dest]} is not read with --compare-fsdp2 (it compares the --accelerate-config's FSDP1 "
                    f"wrapping with its FSDP2 conversion, without LoRA): drop {option[dest]}, or --compare-fsdp2"
                )
        return
    for dest in _COMPARE_ONLY:
        if dest in given:
            raise UsageError(f"{option[dest]} is read with --compare-fsdp2 only: add --compare-fsdp2")
    if "lora_r" in given and args.lora is None:
        raise UsageError("--lora-r is read with --lora only: add --lora NAMES (e.g. --lora q_proj,v_proj)")
    if "adapter" in given and args.lora is None:
        raise UsageError("--adapter checks the adapter --lora adds: add --lora NAMES (e.g. --lora q_proj,v_proj)")
    if "max_lora_rank" in given and not args.adapter:
        raise UsageError("--max-lora-rank is read with --adapter only: add --adapter")


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (argparse itself exits with 2 on a malformed command line)."""
    args = build_parser().parse_args(argv)

    def body() -> int:
        _refuse_ignored(args, _given(argv, args))
        return _check(args)

    return run(COMMAND, body)


if __name__ == "__main__":
    sys.exit(main())
