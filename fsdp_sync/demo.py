"""The main job: a short real GRPO run with FSDPVLLMSyncMixin on a tiny local model, FSDP2 on 2 CPU processes, with
an in-process vLLM engine; prints each sync's figures and the bit-exact weight check.

    fsdp-vllm-sync-demo [--backend fsdp2|fsdp1|ddp] [--steps 3] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _print_results(ranks: list[dict[str, Any]], backend: str) -> bool:
    ok = True
    for r in ranks:
        wrapper = r["wrapper"]
        print(f"\nrank {r['rank']}: model wrapper {wrapper['type']} (backend detected: {r['backend']}), "
              f"{r['global_step']} training steps")
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
    if not all(r["wrapper"][expected] for r in ranks):
        ok = False
        print(f"\nERROR: the model was not wrapped by {backend} (accelerate may have fallen back to DDP)")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["fsdp1", "fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--family", default="qwen2", help="tiny model family (qwen2, llama, qwen3, qwen3_moe)")
    parser.add_argument("--out", default=None, help="where to keep the model, logs and per-rank results")
    args = parser.parse_args(argv)

    from fsdp_sync.testing.launch import launch_job
    from fsdp_sync.testing.models import build_tiny_checkpoint

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fsdp-vllm-sync-demo-"))
    model_dir = build_tiny_checkpoint(out / "model", args.family)
    print(f"tiny {args.family} model written to {model_dir}; launching GRPO on 2 CPU processes with {args.backend} ...")
    job_args = ["--model-dir", str(model_dir), "--out-dir", str(out / "job"), "--check", "--steps", str(args.steps)]
    result = launch_job("fsdp_sync.testing.grpo_job", job_args, out / "job", backend=args.backend)
    if len(result.ranks) != 2:
        print(result.log[-5000:])
        print(f"ERROR: the job exited with {result.returncode}; log: {out / 'job' / 'launch.log'}")
        return 1
    ok = _print_results(result.ranks, args.backend) and result.returncode == 0
    print(f"\nlog: {out / 'job' / 'launch.log'}")
    print("RESULT:", "every sync was bit-exact" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
