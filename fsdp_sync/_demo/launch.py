"""Launch a job on N local CPU processes under an accelerate config for FSDP1, FSDP2, DDP or a single process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..distributed import free_port

logger = logging.getLogger(__name__)

__all__ = ["LaunchRefused", "LaunchResult", "Runner", "accelerate_config", "launch_env", "launch_job"]

# Runs a job's ranks another way than `accelerate launch` (the tests fork them from a process that imported the stack
# once): called with module, job_args, log_path, env, config, num_processes, port and timeout; returns the exit code,
# or raises `LaunchRefused` to have the job launched for real.
Runner = Callable[..., int]


class LaunchRefused(RuntimeError):
    """A `Runner` cannot run this job as `accelerate launch` would (the reason says why); it is launched for real."""


def accelerate_config(
    backend: str, num_processes: int = 2, *, use_orig_params: bool = True, activation_checkpointing: bool = False
) -> dict[str, Any]:
    """An accelerate config (as a dict) for `backend` in {"fsdp1", "fsdp2", "ddp"} on CPU processes.

    `fsdp_sync_module_states` is off: it raises on CPU ("no available devices"); every rank loads the same weights.
    """
    base: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": num_processes,
        "mixed_precision": "no",
        "use_cpu": True,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
    }
    match backend:
        case "ddp":
            # NOTE: accelerate launches MULTI_CPU through mpirun; MULTI_GPU with use_cpu takes torchrun and resolves
            # to MULTI_CPU (DDP over gloo) in the processes.
            return {**base, "distributed_type": "MULTI_GPU"}
        case "fsdp1" | "fsdp2":
            fsdp = {
                "fsdp_version": 1 if backend == "fsdp1" else 2,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "fsdp_cpu_ram_efficient_loading": False,
                "fsdp_sync_module_states": False,
                "fsdp_offload_params": False,
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                "fsdp_reshard_after_forward": True if backend == "fsdp2" else "FULL_SHARD",
                "fsdp_activation_checkpointing": activation_checkpointing,
            }
            if backend == "fsdp1":
                fsdp["fsdp_use_orig_params"] = use_orig_params
                fsdp["fsdp_backward_prefetch"] = "BACKWARD_PRE"
                fsdp["fsdp_forward_prefetch"] = False
            return {**base, "distributed_type": "FSDP", "fsdp_config": fsdp}
        case _:
            raise ValueError(f"Unknown backend {backend!r}; valid: 'fsdp1', 'fsdp2', 'ddp'")


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    ranks: list[dict[str, Any]]
    log: str


def launch_job(
    module: str,
    job_args: list[str],
    out_dir: str | Path,
    *,
    backend: str,
    num_processes: int = 2,
    use_orig_params: bool = True,
    activation_checkpointing: bool = False,
    timeout: float = 900,
    port: int | None = None,
    runner: Runner | None = None,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run `python -m module job_args` on `num_processes` CPU ranks under `backend` ("single": one plain process).

    Each rank of the job is expected to write `out_dir/rank<r>.json`; they are read back in rank order. `runner`, if
    given, runs the ranks first (the tests' fork server); where it refuses, or without one, `accelerate launch`
    starts them. `env`: the ranks' environment (default `launch_env()`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = launch_env() if env is None else env
    config = (
        None
        if backend == "single"
        else accelerate_config(
            backend, num_processes, use_orig_params=use_orig_params, activation_checkpointing=activation_checkpointing
        )
    )
    port = port or free_port()
    log_path = out / "launch.log"
    log_path.write_text("")
    returncode: int | None = None
    refused = ""
    if runner is not None:
        try:
            returncode = runner(
                module=module,
                job_args=job_args,
                log_path=log_path,
                env=env,
                config=config,
                num_processes=1 if config is None else num_processes,
                port=port,
                timeout=timeout,
            )
        except LaunchRefused as e:
            refused = f"[launch] {e}; launched for real\n"
            logger.warning("launching %s with accelerate: %s", module, e)
    if returncode is None:
        if config is None:
            cmd = [sys.executable, "-m", module, *job_args]
        else:
            config_path = out / "accelerate.json"
            config_path.write_text(json.dumps(config))
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path),
                   "--main_process_port", str(port), "-m", module, *job_args]  # fmt: skip
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
        returncode = proc.returncode
        if refused:
            with open(log_path, "a") as log:
                log.write(refused)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return LaunchResult(returncode, ranks, log_path.read_text())


def launch_env() -> dict[str, str]:
    """The environment every job is launched with: this process's, unbuffered, one OpenMP thread a rank."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
