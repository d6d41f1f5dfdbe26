"""One benchmark on the library as it was at a git ref and as it is in this tree, alternately, in one run.

    python -m benchmarks.side_by_side --ref d07e4ae [--rounds 3] [--results DIR] -- adapter --engine buffers \
        --models qwen2-layout --world-size 2 --reps 7

Why: a change's gain is only a gain against the code it replaces, measured on the same machine at the same time
(shared machines drift by tens of percent between runs). Both sides run this tree's benchmark harness and tests'
launcher; only the library (`fsdp_sync`, with `compat`) differs: the ref's is extracted with `git archive` into a
directory of its own. Rounds alternate (ref, this tree, ref, ...); each benchmark run writes its usual JSON rows,
and the table gives, per (model, backend, method), rank 0's median seconds on each side and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _library_at(ref: str, into: Path) -> None:
    """`fsdp_sync` of `ref` under `into`, with `compat/` where the distribution installs it (`fsdp_sync.compat`)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "ref.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref, "fsdp_sync", "compat"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (into / "compat").rename(into / "fsdp_sync" / "compat")
    archive.unlink()


def _side(into: Path, library: Path | None) -> None:
    """A directory to run from: this tree's benchmarks and tests, and the ref's library or this tree's."""
    into.mkdir(parents=True, exist_ok=True)
    for part in ("benchmarks", "tests"):
        (into / part).symlink_to(ROOT / part)
    (into / "fsdp_sync").symlink_to(library if library is not None else ROOT / "fsdp_sync")


def _seconds(directory: Path) -> tuple[dict[tuple[str, str, str], list[float]], dict[tuple[str, str, str], int]]:
    """Rank 0's seconds of every (model, backend, method) over every round, and the tensors each sync sent."""
    seconds: dict[tuple[str, str, str], list[float]] = {}
    tensors: dict[tuple[str, str, str], int] = {}
    for path in directory.glob("*/*.json"):
        for row in json.loads(path.read_text())["rows"]:
            if row.get("rank", 0) == 0 and isinstance(row.get("seconds"), int | float):
                key = (row["model"], row["backend"], row["method"])
                seconds.setdefault(key, []).append(row["seconds"])
                if isinstance(row.get("tensors"), int):
                    tensors[key] = row["tensors"]
    return seconds, tensors


def _per_tensor(rows: list[dict[str, Any]], tensors: dict[tuple[str, str, str], int]) -> list[str]:
    """Where a run has an adapter sync of two sizes (`qv/adapter`, `all/adapter`): each side's time per tensor, the
    slope between them ((all - qv) / (their tensors' difference)), so that the fixed cost a sync is left out."""
    by_key = {(r["model"], r["backend"], r["method"]): r for r in rows}
    lines = []
    for model, backend in sorted({(r["model"], r["backend"]) for r in rows}):
        small, large = (model, backend, "qv/adapter"), (model, backend, "all/adapter")
        if small not in by_key or large not in by_key or tensors.get(large, 0) <= tensors.get(small, 0):
            continue
        more = tensors[large] - tensors[small]
        ref, tree = ((by_key[large][f"{side}_ms"] - by_key[small][f"{side}_ms"]) / more for side in ("ref", "tree"))
        lines.append(f"| {model} | {backend} | {tensors[small]} / {tensors[large]} | {ref:.4f} | {tree:.4f} | "
                     f"{ref / tree:.2f} |")  # fmt: skip
    if not lines:
        return []
    return [
        "",
        "Per tensor: the slope between the q/v adapter sync and the all-linear one, (all - qv) / (their tensors' "
        "difference), so that each sync's fixed cost is left out:",
        "",
        "| model | backend | tensors q/v / all | ref ms per tensor | tree ms per tensor | ref / tree |",
        "|---|---|---|---:|---:|---:|",
        *lines,
    ]


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the git ref whose library is compared with this tree's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- then `benchmarks.run`'s arguments")
    args = parser.parse_args(argv)
    bench = [a for a in args.benchmark if a != "--"]
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        work = Path(tmp)
        _library_at(args.ref, work / "ref-library")
        # NOTE: `python -m` puts the working directory first on sys.path: each side runs from its own directory,
        # whose `fsdp_sync` is the library it measures.
        sides = {"ref": work / "ref", "tree": work / "tree"}
        _side(sides["ref"], work / "ref-library" / "fsdp_sync")
        _side(sides["tree"], None)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for round_ in range(args.rounds):
            for name, cwd in sides.items():
                out = work / "results" / name / f"round{round_}"
                cmd = [sys.executable, "-m", "benchmarks.run", *bench, "--results", str(out)]
                proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                    return 1
                print(f"round {round_}: {name} done", flush=True)
        (ref, tensors), (tree, _) = (_seconds(work / "results" / name) for name in sides)
    rows: list[dict[str, Any]] = []
    for key in sorted(set(ref) & set(tree)):
        a, b = statistics.median(ref[key]), statistics.median(tree[key])
        rows.append({"model": key[0], "backend": key[1], "method": key[2], "ref_ms": a * 1e3, "tree_ms": b * 1e3,
                     "ref_over_tree": a / b, "runs": len(ref[key])})  # fmt: skip
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {_torch_version()}"
    measured = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        f"Measured {measured}. Machine: {machine}.",
        "",
        f"`python -m benchmarks.side_by_side --ref {args.ref} --rounds {args.rounds} -- {' '.join(bench)}`: rank 0's "
        f"median ms over every repetition of every round, the ref's library beside this tree's.",
        "",
        "| model | backend | method | ref ms | tree ms | ref / tree |",
        "|---|---|---|---:|---:|---:|",
        *(f"| {r['model']} | {r['backend']} | {r['method']} | {r['ref_ms']:.2f} | {r['tree_ms']:.2f} | "
          f"{r['ref_over_tree']:.2f} |" for r in rows),  # fmt: skip
        *_per_tensor(rows, tensors),
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    kind = f"side-by-side-{bench[0] if bench else 'run'}"
    (args.results / f"{kind}.json").write_text(json.dumps(
        {"ref": args.ref, "argv": bench, "machine": machine, "measured": measured, "rows": rows,
         "tensors": [[*key, n] for key, n in sorted(tensors.items())]}, indent=1
    ))
    (args.results / f"{kind}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
