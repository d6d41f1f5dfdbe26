"""The bytes a server sync puts on the busiest link, per path (issue 50): a model of what each link carries, checked
against the CPU measurements of `benchmarks.multi_worker`, then applied to a 70B model from 64 trainer GPUs into a
TP8 x DP4 server.

    python -m benchmarks.cost_model   (reads benchmarks/results/multi-worker-cpu.json; writes cost-model.{json,md})

The paths (M: the model's bytes in the engine dtype; N: trainer ranks; TP x DP: the server's workers; `kept`: the
fraction of M a tensor-parallel worker keeps, its cut plus the weights it holds whole):
- `broadcast` (this package before issue 50, gloo): the sender sends every worker every tensor; gloo's broadcast sends
  the root's buffer to each peer in turn, so the sender's link carries TP * DP copies of M.
- `nccl broadcast` (TRL's path, vLLM's NCCL engine): a pipelined ring: every link carries each byte once, M; every
  worker receives M whole.
- `routed` (this package now): every trainer rank holds each full unit while the gather hands it on, and sends its
  share; worker w receives its cut (kept * M), the ranks together DP * TP * kept * M, each about 1/N of it.
- `routed from shards` (not built): each rank sends only what its own FSDP shard holds, without the gather.
Every path but the last also runs the trainer's FSDP all-gather (a ring: (N-1)/N * M into and out of every rank),
which TRL's sync runs as well; it is listed apart. Time: bytes / link bandwidth, nothing overlapped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .run import RESULTS, _save

__all__ = ["Link", "links", "main"]

_GB = 1e9


@dataclass(frozen=True)
class Link:
    """What one path puts on the busiest link of one sync, in bytes."""

    path: str
    worker_in: float  # into each worker (the most loaded)
    sender_out: float  # out of the busiest trainer rank, the transfer only
    gather: float  # into (and out of) each trainer rank by the FSDP all-gather


def links(model: float, senders: int, tp: int, dp: int, kept: float, largest: float) -> list[Link]:
    """Each path's link bytes for one complete sync (see the module docstring). `largest`: the largest cut one
    worker receives of one tensor: a chunk holds whole tensors, so some rank sends at least that much."""
    gather = model * (senders - 1) / senders
    workers = tp * dp
    cut = kept * model if tp > 1 else model
    share = max(dp * tp * cut / senders, largest)
    return [
        Link("broadcast", model, workers * model, gather),
        Link("nccl broadcast", model, model, gather),
        Link("routed", cut, share, gather),
        Link("routed from shards", cut, share, 0.0),
    ]


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (server, trainer, path) of the benchmark: medians of what each worker received and what each trainer rank
    sent over TCP less its FSDP all-gather ((N-1)/N of the model, what a rank that sends nothing else sent), beside
    what the model predicts from the workers' kept bytes."""
    from .multi_worker import SPEC

    syncs = [r for r in rows if r["row"] == "sync" and r["rank"] == 0 and r["kind"] == "complete"]
    servers = {r["server"]: r for r in rows if r["row"] == "server"}
    shards = {r["server"]: r for r in rows if r["row"] == "shards" and r["path"] == "routed"}
    model = max(
        w["whole_bytes"] for s in shards.values() for w in s["workers"].values()
    )  # every weight, whole, in the engine dtype
    out = []
    keys = sorted({(r["server"], r["backend"], r["ranks"], r["path"]) for r in syncs})
    for server, backend, ranks, path in keys:
        chosen = [r for r in syncs if (r["server"], r["backend"], r["ranks"], r["path"]) == (server, backend, ranks, path)]
        workers = list(servers[server]["workers"])
        tags = servers[server]["workers"]
        tp = 2 if server == "tp2" else 1
        dp = 2 if server == "dp2" else 1
        kept = max(shards[server]["workers"][tags[w]]["kept_bytes"] for w in workers) / model
        largest = SPEC.vocab_size * SPEC.hidden_size * 2 / tp  # the (tied) embedding, cut by vocabulary
        predicted = {link.path: link for link in links(model, ranks, tp, dp, kept, largest)}[path]
        received = max(statistics.median(r["received"][w] for r in chosen) for w in workers)
        gather = model * (ranks - 1) / ranks
        share = max(statistics.median(r["sent"][f"trainer-rank{k}"] for r in chosen) - gather for k in range(ranks))
        out.append({
            "server": server, "trainer": f"{backend.upper()} x {ranks}", "path": path,
            "worker_in": received, "worker_in_model": predicted.worker_in,
            "sender_out": share, "sender_out_model": predicted.sender_out,
        })  # fmt: skip
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| server | trainer | path | MB into the busiest worker: measured / model | MB out of the busiest trainer "
        "rank, its FSDP all-gather aside: measured / model |",
        "|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["row"] == "check"):
        lines.append(
            f"| {r['server']} | {r['trainer']} | {r['path']} | {r['worker_in'] / 1e6:.2f} / "
            f"{r['worker_in_model'] / 1e6:.2f} | {r['sender_out'] / 1e6:.2f} / {r['sender_out_model'] / 1e6:.2f} |"
        )
    (big,) = [r for r in rows if r["row"] == "model"]
    lines += [
        "",
        f"{big['label']}: busiest link per complete sync, at {big['bandwidth'] / _GB:.0f} GB/s per link, nothing "
        "overlapped",
        "",
        "| path | GB into each worker | GB out of the busiest trainer rank (transfer) | GB of the FSDP all-gather per "
        "trainer rank | GB on the busiest link | seconds on it |",
        "|---|---|---|---|---|---|",
    ]
    for link in big["links"]:
        busiest = max(link["worker_in"], link["sender_out"] + link["gather"])
        lines.append(
            f"| {link['path']} | {link['worker_in'] / _GB:.1f} | {link['sender_out'] / _GB:.1f} | "
            f"{link['gather'] / _GB:.1f} | {busiest / _GB:.1f} | {busiest / big['bandwidth']:.2f} |"
        )
    return "\n".join(lines) + (
        "\n\n- Measured: `benchmarks/results/multi-worker-cpu.json` (medians of the complete syncs): the bytes each "
        "worker received over TCP and what each trainer rank sent over TCP, less its all-gather ((N-1)/N of the "
        "model); both count chunk trailers and gloo's own framing, the model weight bytes only. A rank's share is at "
        "least the largest cut of one tensor (a chunk holds whole tensors: here the tied embedding, 16.8 MB whole, "
        "8.4 MB cut by TP2).\n"
        "- The 70B row: bf16 (2 bytes a parameter), each TP8 worker keeps 1/8 of the model (the weights every worker "
        "holds whole, norms and row-parallel biases, are under 0.1% of a 70B model and left out); the FSDP all-gather "
        "is the trainer's own, which TRL's sync runs too."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    measured = json.loads((args.results / "multi-worker-cpu.json").read_text())
    rows: list[dict[str, Any]] = [{"row": "check", **r} for r in _measured(measured["rows"])]
    # the largest cut: the embedding (vocabulary 128256 x hidden 8192, bf16) cut by vocabulary over 8 workers
    big = links(70e9 * 2, senders=64, tp=8, dp=4, kept=1 / 8, largest=128256 * 8192 * 2 / 8)
    rows.append({
        "row": "model", "label": "70B bf16, 64 trainer ranks, TP8 x DP4 server (32 workers)", "bandwidth": 50 * _GB,
        "links": [asdict(link) for link in big],
    })  # fmt: skip
    machine = f"model only (no machine); checked against multi-worker-cpu.json measured {measured['measured']}"
    _save(args.results, "cost-model", machine, rows, _table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
