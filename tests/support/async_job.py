"""A short real run of TRL's `AsyncGRPOTrainer` (its rollout worker generating on a real vLLM server), checking the
server after every weight sync.

Launched once per rank (`accelerate launch ... -m tests.support.async_job`, or plainly for one process); each rank
writes `<out>/rank<r>.json` with the wrapper type, the sync reports and, per sync (main process), the check:
- every server weight equals the trainer's full weight bit for bit (the server's own sha256 digests against the
  trainer's weights taken independently, `fsdp_sync._demo.weight_check.full_reference_model`), and its first-token logprobs equal the
  trainer's model's;
- the server's weight version names the trainer's `model_version`, and the rollout worker was told that version;
- the rollouts the trainer consumed carry their policy version (recorded with the trainer's version at that time);
- (main process) what the server answered to `GET /is_paused`, polled from a thread through the whole sync, against
  when this process moved the sync's data (`tests.support.pause_watch`).
Before training the trainer's weights are perturbed away from the server's checkpoint, so the first sync must change
every server weight. `--stock` runs TRL's own sync instead (no mixin), with a gloo stand-in for its NCCL client, and
records what the server then holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fsdp_sync._demo.grpo_job import reward
from fsdp_sync._demo.weight_check import PROMPTS, full_reference_model, wrapper_info


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--server-url", required=True)
    p.add_argument("--group-port", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--perturb", type=float, default=0.02)
    p.add_argument("--sparse", action="store_true", help="SyncConfig(sparse=True)")
    p.add_argument("--no-delta", action="store_true", help="SyncConfig(delta=False)")
    p.add_argument("--verify", action="store_true", help="SyncConfig(verify=True)")
    p.add_argument("--check", action="store_true", help="bit-exact server check after every sync")
    p.add_argument("--stock", action="store_true", help="TRL's own sync (no mixin), with a gloo stand-in for NCCL")
    p.add_argument("--peft", action="store_true", help="train a rsLoRA adapter (r=4, alpha=6 on q_proj and v_proj)")
    p.add_argument("--adapter", action="store_true", help="SyncConfig(adapter=True): push the adapter alone")
    p.add_argument("--max-staleness", type=int, default=4, help="AsyncGRPOConfig.max_staleness")
    p.add_argument("--sync-timeout-s", type=float, default=120.0)
    p.add_argument(
        "--fault-at",
        type=int,
        default=None,
        help="make this sync (1-based) fail on the last rank (its gather raises), then sync again by hand",
    )
    p.add_argument(
        "--barrier-fault",
        action="append",
        default=[],
        metavar="SYNC:FROM_END",
        help="fault injection from outside the library on the last rank (tests.support.outside_faults): its "
        "torch.distributed.monitored_barrier raises in agreement FROM_END (0: the last) of sync SYNC (1-based); a "
        "sync that landed all the same is not tried again",
    )
    return p.parse_args(argv)


def _worker_version(trainer: Any) -> int | None:
    """The policy version the rollout worker was told (main process, once TRL started it), else None."""
    worker = getattr(trainer, "rollout_worker", None)
    return int(worker.model_version) if worker is not None else None


def _setup_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tokenizer(model_dir: str) -> Any:
    """The tiny model's tokenizer with a chat template TRL's rollout worker can parse responses of (Qwen2.5's)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


class _RolloutVersions:
    """The policy version of every rollout the trainer consumes (main process), with the trainer's version then."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.seen: list[tuple[int, int]] = []
        queue = trainer.rollout_queue
        get = queue.get

        def recorded_get(*args: Any, **kwargs: Any) -> Any:
            sample = get(*args, **kwargs)
            self.seen.append((int(sample.model_version), int(trainer.model_version)))
            return sample

        # NOTE: an instance attribute of the parent's queue; the child got the queue pickled at spawn, without it.
        queue.get = recorded_get


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from fsdp_sync import FSDPVLLMSyncMixin, SyncConfig
    from tests.support.async_cpu import enable_async_grpo_on_cpu
    from fsdp_sync._demo.cpu_fsdp import enable_real_fsdp_on_cpu, restore_fsdp_distributed_type
    from fsdp_sync._demo.weight_check import ServerChecker
    from tests.support.checks import AdapterServerChecker
    from tests.support.pause_watch import PauseWatch
    from fsdp_sync.faults import Injector, injecting

    enable_real_fsdp_on_cpu()
    enable_async_grpo_on_cpu()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record: dict[str, Any] = {
        "rank": rank, "world_size": world, "syncs": [], "checks": [], "errors": [], "pauses": [], "sync_seconds": [],
        "pause_watch": [],
    }  # fmt: skip
    checks: list[dict[str, Any]] = record["checks"]
    sync_index = {"n": 0}
    from tests.support.outside_faults import BarrierFaults

    barriers = BarrierFaults(args.barrier_fault, rank == world - 1)
    record["barrier_faults"] = barriers.fired

    class Trainer(FSDPVLLMSyncMixin, AsyncGRPOTrainer):
        """A user's subclass: checks the server after each sync (what a callback of theirs could do)."""

        def _sync_weight(self) -> None:
            self._sync_weight_checked()

        def _attempt(self, faulted: str | None) -> None:
            """One try of the library's sync. On the sender (rank 0) the server's own `/is_paused` is polled through
            it: one window per try, so that a failed try's pause for its write is never counted against the data
            its retry moves."""
            watch = PauseWatch(args.server_url) if rank == 0 else contextlib.nullcontext()
            ok = landed = False
            # a later sync of the usual shape (not the first, not a retry): its agreements are counted
            retry = faulted == "retry"
            barriers.start(0 if retry else sync_index["n"], shaped=sync_index["n"] > 1 and not retry)
            try:
                with watch:
                    if faulted not in (None, "retry") and rank == world - 1:
                        with injecting(Injector(lambda point, context: point == faulted)):
                            super()._sync_weight()
                    else:
                        super()._sync_weight()
                ok = True
            except Exception as e:
                landed = bool(getattr(e, "landed", False))
                raise
            finally:
                barriers.done(ok)
                if rank == 0:
                    # NOTE: a try that landed (it failed after its commit point) wrote the server like one that
                    # succeeded: its pause window is counted with theirs.
                    record["pause_watch"].append({**watch.summary(), "ok": ok or landed})

        def _sync_weight_checked(self) -> None:
            import requests

            sync_index["n"] += 1
            faulted = "gather.prepare" if sync_index["n"] == args.fault_at else None
            outside = sync_index["n"] in {int(spec.split(":")[0]) for spec in args.barrier_fault}
            # Read from outside the library: the server's weight version and the rollout worker's (main process).
            version_before = requests.get(f"{args.server_url}/weight_info", timeout=30).json()["weight_version"]
            worker_before = _worker_version(self)
            started = time.perf_counter()
            try:
                self._attempt(faulted)
            except Exception as e:  # noqa: BLE001 - recorded, then synced again below
                from fsdp_sync.errors import SyncError

                paused = requests.get(f"{args.server_url}/is_paused", timeout=30).json()["is_paused"]
                record["errors"].append(
                    {"sync": sync_index["n"], "type": type(e).__name__, "message": str(e)[:2000],
                     "is_sync_error": isinstance(e, SyncError), "seconds": time.perf_counter() - started,
                     "landed": bool(getattr(e, "landed", False)),
                     "version": getattr(getattr(e, "engine", None), "version", None),
                     "model_version": self.model_version, "engine_is_current": self.engine_is_current,
                     "server_paused_after": paused, "server_weight_version_before": version_before,
                     "server_weight_version_after": requests.get(f"{args.server_url}/weight_info",
                                                                 timeout=30).json()["weight_version"],
                     "rollout_worker_version_before": worker_before,
                     "rollout_worker_version_after": _worker_version(self)}  # fmt: skip
                )
                if faulted is None and not outside:
                    raise
                if not getattr(e, "landed", False):
                    self._attempt("retry")  # the retry: must be complete and exact
            record["sync_seconds"].append(time.perf_counter() - started)
            writer = getattr(self._fvs_sync, "writer", None)
            record["pauses"].append(getattr(writer, "last_pause", None))
            checker_step()

    class StockTrainer(AsyncGRPOTrainer):
        def _sync_weight(self) -> None:
            sync_index["n"] += 1
            # NOTE: written before TRL's sync, which may die (FSDP1): the test asserts the wrapper it ran under.
            (Path(args.out_dir) / f"wrapper-rank{rank}.json").write_text(json.dumps(wrapper_info(self.model_wrapped)))
            started = time.perf_counter()
            super()._sync_weight()
            record["sync_seconds"].append(time.perf_counter() - started)
            checker_step()

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    config = AsyncGRPOConfig(
        output_dir=str(Path(args.out_dir) / "trainer"),
        vllm_server_base_url=args.server_url,
        vllm_server_timeout=120,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        weight_sync_steps=1,
        max_staleness=args.max_staleness,
        queue_maxsize=32,
        max_inflight_tasks=4,
        learning_rate=args.lr,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
    )
    tokenizer = _tokenizer(args.model_dir)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        # NOTE: rsLoRA (scaling alpha/sqrt(r) = 3, not a power of two): the merged push is checked bit for bit against
        # PEFT's own merge, so a scaling applied in another place or dtype shows.
        peft_config = LoraConfig(
            r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    stand_in = None
    if args.stock:
        from tests.support.stock_async import GlooStandIn

        stand_in = GlooStandIn(args.server_url, args.group_port) if rank == 0 else None
        trainer = StockTrainer(
            model=args.model_dir, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
            weight_transfer=stand_in, peft_config=peft_config,
        )  # fmt: skip
        if stand_in is not None:
            stand_in.describe(trainer.model)
    else:
        sync_config = SyncConfig(
            group_port=args.group_port,
            sparse=args.sparse,
            delta=not args.no_delta,
            verify=args.verify,
            adapter=True if args.adapter else None,
            sync_timeout_s=args.sync_timeout_s,
            server_timeout_s=min(args.sync_timeout_s - 5, 60.0),
        )
        trainer = Trainer(
            model=args.model_dir, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
            sync_config=sync_config, peft_config=peft_config,
        )  # fmt: skip
    restore_fsdp_distributed_type(trainer)
    torch.manual_seed(1234)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" not in name:  # the base moves away from the server's checkpoint; adapters train from PEFT's init
                p.add_(torch.randn_like(p) * args.perturb)
    versions = _RolloutVersions(trainer) if trainer.accelerator.is_main_process else None
    names = Path(args.out_dir) / "rollout-names.txt"
    if args.adapter and trainer.rollout_worker is not None:
        from tests.support.rollout_names import NAMES_ENV, RecordingLoop

        # Test-side: the rollout process records the model of each request it sends (read from outside the library).
        os.environ[NAMES_ENV] = str(names)
        trainer.rollout_worker._loop_cls = RecordingLoop
    checker_class = AdapterServerChecker if args.adapter else ServerChecker
    checker = checker_class(trainer, peft_config, args.server_url) if args.check else None

    def checker_step() -> None:
        if checker is None:
            return
        # NOTE: the trainer's config asks for TRL's tree attention (its packed training rows); the reference model the
        # check builds from it runs plain sequences, so it is built with torch's attention, and the config restored.
        config = trainer.accelerator.unwrap_model(trainer.model).config
        attention = config._attn_implementation
        config._attn_implementation = "sdpa"
        try:
            checker()  # every rank: the reference gather is a collective
        finally:
            config._attn_implementation = attention
        entry = checker.records[-1]
        entry.pop("greedy", None)
        entry["model_version"] = trainer.model_version
        entry["server_weight_version"] = checker.client.weight_version()
        worker = trainer.rollout_worker
        entry["rollout_worker_version"] = worker.model_version if worker is not None else None
        checks.append(entry)

    trainer.train()
    record["wrapper"] = wrapper_info(trainer.model_wrapped)
    record["model_version"] = trainer.model_version
    record["syncs"] = [r.as_dict() for r in getattr(trainer, "sync_reports", [])]
    record["rollout_versions"] = versions.seen if versions is not None else []
    record["rollout_names"] = names.read_text().split() if names.exists() else []
    record["log_history"] = trainer.state.log_history  # what training did (a step with no gradient moves nothing)
    if stand_in is not None:
        record["pauses"] = [(paused, None) for paused in stand_in.pauses]
        record["stock_bytes"] = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in stand_in.manifest)
    return record


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _setup_env()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        record = run(args)
        code = 0
    except BaseException as e:  # noqa: BLE001 - recorded for the test
        record = {"rank": rank, "fatal": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        code = 1
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1, default=str))
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
