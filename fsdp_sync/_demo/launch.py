"""Launch a job on N local CPU processes under an accelerate config for FSDP1, FSDP2, DDP or a single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dist import free_port

__all__ = ["LaunchResult", "accelerate_config", "launch_job"]


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
) -> LaunchResult:
    """Run `python -m module job_args` on `num_processes` CPU ranks under `backend` ("single": one plain process).

    Each rank of the job is expected to write `out_dir/rank<r>.json`; they are read back in rank order.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if backend == "single":
        cmd = [sys.executable, "-m", module, *job_args]
    else:
        config = out / "accelerate.json"
        config.write_text(
            json.dumps(
                accelerate_config(
                    backend,
                    num_processes,
                    use_orig_params=use_orig_params,
                    activation_checkpointing=activation_checkpointing,
                )
            )
        )
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(port or free_port()),
            "-m",
            module,
            *job_args,
        ]
    with open(out / "launch.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return LaunchResult(proc.returncode, ranks, (out / "launch.log").read_text())
