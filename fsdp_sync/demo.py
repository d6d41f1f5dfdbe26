"""`fsdp-vllm-sync-demo`, the main job: a short real GRPO run with FSDPVLLMSyncMixin on a tiny local model.

    fsdp-vllm-sync-demo [--backend fsdp2|fsdp1|ddp] [--vllm-mode colocate|server] [--steps 3] [--family qwen2]
                        [--out runs/demo]

Two CPU processes under `accelerate launch`; colocate: an in-process vLLM engine in each; server: one real vLLM
server process on 127.0.0.1 (started and stopped here, weight transfer over gloo). Prints each sync's figures and
the bit-exact weight check (server mode: read back from the server).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from .cli import EXIT_FAILED, EXIT_OK, UsageError, make_parser, positive_int, require, run
from ._demo.models import FAMILIES

__all__ = ["build_parser", "main"]

COMMAND = "fsdp-vllm-sync-demo"

# The job runs TRL, accelerate and vLLM's CPU build in its processes; all come with the pinned CPU stack.
_NEEDS: dict[str, str] = {name: "test" for name in ("transformers", "trl", "accelerate", "datasets", "vllm")}

DESCRIPTION = """\
The main job: a short real GRPO run with FSDPVLLMSyncMixin on a tiny local model, on 2 CPU processes under
accelerate, with an in-process vLLM engine in each (colocate) or one vLLM server process on 127.0.0.1 that the demo
starts and stops (server). Prints each sync's tensors, MB, ms, GB/s and peak extra memory, and checks after every
sync that every engine weight equals the trainer's, bit for bit.

Needs the pinned CPU stack (vLLM's CPU build, a CPU torch): `.ci/setup` in a clone, or
pip install 'fsdp-vllm-sync[test]' with PyTorch's CPU wheel index as an extra index."""

EPILOG = """\
exit codes:
  0  every sync was bit-exact
  1  the job failed or a sync was not bit-exact (the log's path is printed)
  2  a mistake in the arguments, or a missing dependency (one line on stderr)"""


def _print_results(ranks: list[dict[str, Any]], backend: str) -> bool:
    ok = len(ranks) == 2
    for r in ranks:
        if r["error"] and r["error"].get("stage") == "construct":
            print(f"\nrank {r['rank']}: ERROR building the trainer: {r['error']['type']}: {r['error']['message']}")
            ok = False
            continue
        wrapper = r["wrapper"]
        writer = r["reports"][0]["writer"] if r["reports"] else "none"
        print(f"\nrank {r['rank']}: model wrapper {wrapper['type']} (backend detected: {r['backend']}, writer "
              f"{writer}), {r['global_step']} training steps")
        print(f"  {'sync':>4} {'step':>4} {'tensors':>7} {'MB':>8} {'ms':>8} {'GB/s':>7} {'peak MB':>8}  weight check")
        for i, (rep, check) in enumerate(zip(r["reports"], r["checks"], strict=False)):
            problems = check["reference_problems"] + check["direct_problems"]
            verdict = (
                f"OK: {check['engine_weights']} engine weights equal the trainer's, bit for bit"
                if not problems
                else f"FAILED: {len(problems)} mismatches, e.g. {problems[0]}"
            )
            ok &= not problems
            print(
                f"  {i:>4} {check['step']:>4} {rep['tensors']:>7} {rep['bytes'] / 1e6:>8.3f} {rep['seconds'] * 1e3:>8.1f} "
                f"{rep['gbps']:>7.3f} {rep['peak_extra_bytes'] / 1e6:>8.3f}  {verdict}"
            )
        changed = r["checks"] and r["checks"][0]["greedy"] != r["checks"][-1]["greedy"]
        print(f"  greedy generations changed with training: {'yes' if changed else 'no'}")
        if r["error"]:
            ok = False
            print(f"  ERROR: {r['error']['type']}: {r['error']['message']}")
    expected = {"fsdp1": "is_fsdp1", "fsdp2": "is_fsdp2", "ddp": "is_ddp"}[backend]
    if not all(r.get("wrapper", {}).get(expected) for r in ranks):
        ok = False
        print(f"\nERROR: the model was not wrapped by {backend} (accelerate may have fallen back to DDP)")
    return ok


def build_parser() -> argparse.ArgumentParser:
    """The command line of `fsdp-vllm-sync-demo`; new options go here."""
    parser = make_parser(COMMAND, DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "--backend", choices=["fsdp2", "fsdp1", "ddp"], default="fsdp2", help="how accelerate wraps the model"
    )
    parser.add_argument(
        "--vllm-mode",
        choices=["colocate", "server"],
        default="colocate",
        help="colocate: an in-process engine per rank; server: one vLLM server process on 127.0.0.1, started and "
        "stopped by the demo (gloo weight transfer)",
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps; each starts with a weight sync")
    parser.add_argument(
        "--family", choices=sorted(FAMILIES), default="qwen2", help="the tiny model's family (built from a config)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to keep the model, the logs and the per-rank results (default: a new temporary directory)",
    )
    return parser


def _demo(args: argparse.Namespace) -> int:
    require(_NEEDS, hint="(with PyTorch's CPU wheel index as an extra index; or run .ci/setup in a clone)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory; name a directory (it is created if new)")

    from ._demo.launch import launch_job
    from ._demo.models import build_tiny_checkpoint

    out = args.out or Path(tempfile.mkdtemp(prefix="fsdp-vllm-sync-demo-"))
    model_dir = build_tiny_checkpoint(out / "model", args.family)
    print(f"tiny {args.family} model written to {model_dir}")
    job_args = ["--model-dir", str(model_dir), "--out-dir", str(out / "job"), "--check", "--steps", str(args.steps)]
    with contextlib.ExitStack() as stack:
        if args.vllm_mode == "server":
            from .distributed import free_port
            from ._demo.vllm_server import VLLMServerProcess

            print("starting a vLLM server on 127.0.0.1 (weight transfer: gloo) ...")
            server = stack.enter_context(VLLMServerProcess(model_dir, out / "server.log"))
            print(f"server up at {server.base_url} after {server.startup_seconds:.0f} s (log: {out / 'server.log'})")
            job_args += ["--vllm-mode", "server", "--server-url", server.base_url, "--group-port", str(free_port())]
        print(f"launching GRPO on 2 CPU processes with {args.backend}, vLLM mode {args.vllm_mode} ...")
        result = launch_job("fsdp_sync._demo.grpo_job", job_args, out / "job", backend=args.backend)
    if len(result.ranks) != 2:
        print(result.log[-5000:])
        print(f"ERROR: the job exited with {result.returncode}; log: {out / 'job' / 'launch.log'}")
        return EXIT_FAILED
    ok = _print_results(result.ranks, args.backend) and result.returncode == 0
    print(f"\nlog: {out / 'job' / 'launch.log'}")
    print("RESULT:", "every sync was bit-exact" if ok else "FAILED")
    return EXIT_OK if ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (argparse itself exits with 2 on a malformed command line)."""
    args = build_parser().parse_args(argv)
    return run(COMMAND, lambda: _demo(args))


if __name__ == "__main__":
    sys.exit(main())
