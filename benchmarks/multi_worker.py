"""Syncs into multi-worker vLLM CPU servers (issues 40 and 50): a tensor-parallel and a data-parallel server beside a
single-worker one, the same checkpoint and the same sync work, from FSDP2 and FSDP1 trainers of 2 and 3 ranks, each
through the broadcast path (the sender sends every worker every tensor) and the routed one (every trainer rank sends
its share, each worker receives its cut), in one run.

    python -m benchmarks.multi_worker [--reps 5]   (the results in benchmarks/results: --reps 6)
    python -m benchmarks.multi_worker --sparse --trainers fsdp2x2   (sparse syncs: multi-worker-sparse-cpu.md)

For each server in turn (each stopped before the next starts: a multi-worker server pins both cores):
- `single`: docs/server.md's tensor-parallel CPU command without `--tensor-parallel-size 2` and without its per-worker
  CPU binding (one worker; the same arguments otherwise);
- `tp2`, `dp2`: docs/server.md's two commands as written (`tests/e2e/documented.py`), `VLLM_CPU_OMP_THREADS_BIND="0|1"`.
Every server gets the test-side readable weights (`VLLMServerProcess(readable_weights=True)`): each worker's cut of
each weight is read from the worker itself (`compat/tp_shards.py`), and after each trainer's last sync every weight of
every worker is checked bit for bit (each shard of each replica against the trainer's weight cut as that worker's
loader cuts it).

Per trainer (FSDP2 x 2 ranks, FSDP1 x 2, FSDP2 x 3; one unit per decoder layer plus the root; `SyncConfig()`) and path
(`broadcast`: the writer built with its routing off, as before issue 50; `routed`: the default), the library's server
writer (`fsdp_sync.assemble.build_sync`, gloo weight transfer): one cold sync (the handshake and a complete sync),
then per repetition one Adam step and, alternating in order, a `delta` sync (every parameter is trainable, so it
sends every tensor too) and a `complete` one (`resync()` first). Per sync: the sync's own report (rank 0: seconds),
the bytes each trainer rank put on the transfer's wire (`ServerWriter.sent_bytes`: its share), what every server
process and every trainer rank received and sent over TCP meanwhile (the kernel's per-socket counters, `ss -tinp`:
gloo's connections are TCP, so a worker's count is the bytes it received), and the CPU seconds of every server
process. Per worker: the bytes of the weights it holds, whole and as its shard, and its peak RSS (`VmHWM`).
Writes benchmarks/results/multi-worker-cpu.{json,md}.

With `--sparse`, each repetition is one Adam step at `SPARSE_LR` and one sparse sync: what each worker received
(measured) against one whole copy of the sync's patches, broadcast and routed (rank 0 sends each worker only the
changes inside its cut). Writes benchmarks/results/multi-worker-sparse-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fsdp_sync._demo.models import TinySpec

from .run import RESULTS, _save

__all__ = ["SERVERS", "SPEC", "multi_worker_rank", "multi_worker_rows", "multi_worker_sparse_table", "multi_worker_table"]

# Qwen2-style, about 20M parameters (41 MB a sync in bf16): big enough that a sync is not all overhead, small enough
# that three servers start and sync within a few minutes on 2 cores. Two KV heads: each TP2 worker holds one of them.
SPEC = TinySpec(
    family="qwen2", hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, vocab_size=16384, tie_word_embeddings=True,
)  # fmt: skip
SPEC_NAME = "qwen2-20m"
# Server name -> the parallel flag of docs/server.md's command (single: the tensor-parallel command without it).
SERVERS = {"single": None, "tp2": "--tensor-parallel-size 2", "dp2": "--data-parallel-size 2"}
# (backend, trainer ranks), and the two paths of issue 50.
TRAINERS = (("fsdp2", 2), ("fsdp1", 2), ("fsdp2", 3))
PATHS = ("broadcast", "routed")
# The sparse runs' learning rate: about 2% of bf16 values change per Adam step (benchmarks/results/sparse-cpu.md).
SPARSE_LR = 1e-6
_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_MB = 1e6


def _server(name: str, model_dir: Path, log_path: Path) -> Any:
    """docs/server.md's command for `name` (`SERVERS`), readable weights on."""
    from tests.e2e.documented import DocumentedServer

    flag = SERVERS[name]
    server = DocumentedServer(model_dir, log_path, "server.md", flag or SERVERS["tp2"], readable_weights=True)
    if flag is None:
        # NOTE: one worker takes one CPU list, and "0|1" names two: without it vLLM binds its one worker itself.
        option = server.words.index(SERVERS["tp2"].split()[0])
        del server.words[option : option + 2]
        server.env.pop(_BIND_ENV)
    return server


def _server_processes(pid: int) -> dict[str, int]:
    """Every process of a server (the API server and its descendants), by process title (`VLLM::Worker_TP0`); a
    title that several processes share (each data-parallel engine core's `VLLM::Worker`) with its parent's."""
    import psutil

    root = psutil.Process(pid)
    children = root.children(recursive=True)
    titles = {c.pid: " ".join(c.cmdline()).strip() or c.name() for c in children}
    titles[pid] = "api_server"
    shared = {t for t in titles.values() if list(titles.values()).count(t) > 1}
    procs = {}
    for child in children:
        title = titles[child.pid]
        if not title.startswith("VLLM::"):
            title = f"{child.name()}-{child.pid}"
        elif title in shared:
            title = f"{title}@{titles.get(child.ppid(), child.ppid())}"
        procs[title] = child.pid
    return {"api_server": pid, **procs}


def _workers(procs: dict[str, int]) -> list[str]:
    """The processes that hold the model (vLLM's worker processes; one per engine core where there is no tensor
    parallelism)."""
    return sorted(name for name in procs if name.startswith("VLLM::Worker"))


def _worker_tag(process: str) -> str:
    """The `/weight_checker` tag of a worker process (`VLLM::Worker_TP1` -> `dp0:pp0:pcp0:tp1`,
    `VLLM::Worker@VLLM::EngineCore_DP1` -> `dp1:pp0:pcp0:tp0`)."""
    dp = re.search(r"DP(\d+)", process)
    tp = re.search(r"TP(\d+)", process)
    return f"dp{dp.group(1) if dp else 0}:pp0:pcp0:tp{tp.group(1) if tp else 0}"


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(f"/proc/{pid}/status has no {field}")


_SS_OWNER = re.compile(r"pid=(\d+)")
_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


def _tcp_bytes(pids: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(received, sent) over the open TCP sockets of each process, from the kernel's counters (`ss -tinp`).

    NOTE: read from the sockets, not from `/proc/<pid>/io`: gloo's reads do not count in `rchar` (measured: 0 on the
    workers while the trainer's `wchar` grew by every byte it sent). A socket opened and closed between two reads
    (an HTTP request) is not counted; gloo's connections stay open.
    """
    import subprocess

    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    received: dict[int, int] = {}
    sent: dict[int, int] = {}
    owners: set[int] = set()
    for line in out:
        if not line[:1].isspace():  # a socket's line: its owners; the next, indented, line: its counters
            owners = {int(p) for p in _SS_OWNER.findall(line)}
            continue
        counts = dict(_SS_BYTES.findall(line))
        for pid in owners:
            received[pid] = received.get(pid, 0) + int(counts.get("received", 0))
            sent[pid] = sent.get(pid, 0) + int(counts.get("sent", 0))
    return {name: (received.get(pid, 0), sent.get(pid, 0)) for name, pid in pids.items()}


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User and system CPU seconds of each process so far."""
    import psutil

    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


def _kept_elements(parts: list[torch.Tensor], rule: dict[str, Any]) -> int:
    """Elements of the full checkpoint tensors `parts` that a worker's cut `rule` keeps (padding rows not counted)."""
    dim = rule.get("dim")
    if dim is None:
        return sum(p.numel() for p in parts)
    return sum(size * (p.numel() // p.shape[dim]) for p, (_, size) in zip(parts, rule["parts"]))


def _shards(wrapped: torch.nn.Module, model_dir: str, base_url: str, dtype: torch.dtype) -> dict[str, Any] | None:
    """On every rank (a collective); rank 0: each worker's full and kept bytes of every weight it holds, and the
    bit-exact check of every worker's weights against the trainer's (None on the other ranks)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from fsdp_sync.compat.engine_api import engine_model_class, engine_name_mapper, packed_modules_for_architectures
    from fsdp_sync._demo.engine import by_engine_name, expected_checkpoint_state, expected_engine_parts
    from fsdp_sync._demo.engine import worker_digest_check
    from fsdp_sync._demo.vllm_server import server_shard_rules, server_worker_digests

    # NOTE: no cpu_offload: the trainer is on the CPU already, and FSDP1's offloading state dict segfaulted there
    # (torch 2.13, a clone of a freed flat-parameter view).
    state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() != 0:
        return None
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full.load_state_dict(state)
    architectures = list(full.config.architectures)
    checkpoint = by_engine_name(expected_checkpoint_state(full), engine_name_mapper(engine_model_class(architectures)))
    packed = packed_modules_for_architectures(architectures)
    workers = server_worker_digests(base_url)
    rules = server_shard_rules(base_url, workers)
    checked, problems = worker_digest_check(workers, rules, checkpoint, packed, dtype)
    itemsize = dtype.itemsize
    per_worker: dict[str, dict[str, Any]] = {}
    for worker, digests in sorted(workers.items()):
        whole = kept = 0
        uncounted = []
        for name in sorted(digests):
            parts = expected_engine_parts(name, checkpoint, packed)
            rule = rules.get(worker, {}).get(name)
            if parts is None or rule is None:
                uncounted.append(name)
                continue
            whole += sum(p.numel() for p in parts) * itemsize
            kept += _kept_elements(parts, rule) * itemsize
        per_worker[worker] = {"weights": len(digests), "whole_bytes": whole, "kept_bytes": kept, "uncounted": uncounted}
    return {"workers": per_worker, "checked": checked, "problems": problems}


def multi_worker_rank(
    rank: int, world_size: int, server: str, backend: str, path: str, model_dir: str, base_url: str, group_port: int,
    reps: int, server_pids: dict[str, int], sparse: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """One trainer rank: the cold sync, then `reps` x (an Adam step, a delta and a complete sync, alternating order;
    `sparse`: an Adam step at `SPARSE_LR` and a sparse sync); rank 0 also reads every process's I/O counters around
    each sync and, at the end, the workers' shards. `path` "broadcast" builds the writer with its routing off
    (`ServerWriter.shares`, read once when the sync is built)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fsdp_sync.assemble import build_sync
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.report import SparseFigures

    from .common import server_writer, wrap_fsdp
    from .sparse import _train_step

    device = torch.device("cpu")
    writer = server_writer(base_url, rank, group_port)
    writer.shares = path == "routed"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    wrapped = wrap_fsdp(model, backend, device)
    sync = build_sync(wrapped, writer, SyncConfig(sparse=sparse), device=device)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=SPARSE_LR if sparse else 1e-4)
    trainer_pids: list[int] = [0] * world_size
    dist.all_gather_object(trainer_pids, os.getpid())
    watched = {**{f"trainer-rank{r}": pid for r, pid in enumerate(trainer_pids)}, **server_pids}
    rows: list[dict[str, Any]] = []

    def run(kind: str, rep: int) -> None:
        if kind == "complete":
            sync.resync()
        # NOTE: idle first: vLLM's shared-memory readers busy-loop for 1 s after each message (`SpinCondition`,
        # `busy_loop_s=1`), so a sync that starts within 1 s of the last one shares the 2 cores with them.
        time.sleep(1.2)
        dist.barrier()
        before = _tcp_bytes(watched) if rank == 0 else {}
        dist.barrier()
        # NOTE: the CPU seconds right around rank 0's sync (the server has answered by its end), not around the
        # barriers and socket reads.
        cpu_before = _cpu_seconds(server_pids) if rank == 0 else {}
        started = time.perf_counter()
        report = sync.sync()
        wall = time.perf_counter() - started
        cpu_after = _cpu_seconds(server_pids) if rank == 0 else {}
        dist.barrier()
        after = _tcp_bytes(watched) if rank == 0 else {}
        assert report.ok, report
        shares: list[int] = [0] * world_size
        dist.all_gather_object(shares, writer.sent_bytes)
        rows.append({
            "row": "sync", "server": server, "backend": backend, "ranks": world_size, "path": path, "kind": kind,
            "rep": rep, "rank": rank, "seconds": report.seconds, "shares": shares,
            "wall_seconds": wall, "tensors": report.tensors, "bytes": report.bytes, "complete": report.complete,
            "received": {n: after[n][0] - before[n][0] for n in after},
            "sent": {n: after[n][1] - before[n][1] for n in after},
            "cpu_seconds": {n: cpu_after[n] - cpu_before[n] for n in cpu_after},
            "sparse": report.sparse, "changed_fraction": report.changed_fraction,
            "encoded_bytes": figures.encoded_bytes if (figures := report.figure(SparseFigures)) is not None else 0,
            "worker_bytes": list(report.worker_bytes),
        })  # fmt: skip

    run("first", 0)
    for rep in range(reps):
        _train_step(wrapped, optimizer, vocab, rep)
        if sparse:
            run("sparse", rep)
            continue
        for kind in ("delta", "complete") if rep % 2 == 0 else ("complete", "delta"):
            run(kind, rep)
    shards = _shards(wrapped, model_dir, base_url, writer.engine_dtype or torch.float32)
    if shards is not None:
        rows.append({
            "row": "shards", "server": server, "backend": backend, "ranks": world_size, "path": path, "rank": rank,
            **shards,
        })  # fmt: skip
    return rows


def multi_worker_rows(
    reps: int,
    servers: tuple[str, ...] = tuple(SERVERS),
    trainers: tuple[tuple[str, int], ...] = TRAINERS,
    sparse: bool = False,
) -> list[dict[str, Any]]:
    """Every server of `SERVERS` in turn, the same checkpoint and the same trainer work against each."""
    from tests.support.dist import free_port, run_distributed
    from fsdp_sync._demo.models import build_tiny_checkpoint

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_checkpoint(Path(tmp) / SPEC_NAME, SPEC)
        for name in servers:
            server = _server(name, model_dir, Path(tmp) / f"{name}.log")
            with server:
                procs = _server_processes(server.process.pid)
                workers = _workers(procs)
                results = []
                for backend, ranks in trainers:
                    for path in PATHS:
                        try:
                            results += run_distributed(
                                multi_worker_rank, name, backend, path, str(model_dir), server.base_url, free_port(),
                                reps, procs, sparse, world_size=ranks, backend="gloo",
                            )  # fmt: skip
                        except RuntimeError as e:
                            raise RuntimeError(
                                f"the {name} server's syncs ({backend} x {ranks}, {path}) failed; server log:\n"
                                f"{server.log_tail()}"
                            ) from e
                        server.raise_on_worker_death()
                rows.append({
                    "row": "server", "server": name, "startup_seconds": server.startup_seconds,
                    "command": " ".join(server.words), "env": dict(server.env),
                    "workers": {w: _worker_tag(w) for w in workers},
                    "peak_rss": {p: _status_kib(pid, "VmHWM") * 1024 for p, pid in procs.items()},
                    "rss": {p: _status_kib(pid, "VmRSS") * 1024 for p, pid in procs.items()},
                })  # fmt: skip
            for rank_rows in results:
                rows.extend(rank_rows)
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _trainer(r: dict[str, Any]) -> str:
    return f"{r['backend'].upper()} x {r['ranks']}"


def _verdict(checks: list[dict[str, Any]], server: str) -> tuple[list[dict[str, Any]], str]:
    """`server`'s shard checks (one per trainer run) and what they found."""
    mine = [c for c in checks if c["server"] == server]
    wrong = [f"{_trainer(c)} {c['path']}: {len(c['problems'])}" for c in mine if c["problems"]]
    return mine, "every weight equal" if not wrong else f"problems: {'; '.join(wrong)}"


def multi_worker_table(rows: list[dict[str, Any]]) -> str:
    """Per server, trainer and path: the complete sync's median time against the single-worker server and against the
    other path, what each worker received, what each trainer rank put on the wire; then per worker what it keeps."""
    servers = {r["server"]: r for r in rows if r["row"] == "server"}
    checks = [r for r in rows if r["row"] == "shards"]
    syncs = [r for r in rows if r["row"] == "sync" and r["rank"] == 0]
    keys = sorted({(_trainer(r), r["path"]) for r in syncs}, key=lambda k: (k[0], PATHS.index(k[1])))
    lines = [
        "| server | trainer | path | complete sync ms (median) | vs single | routed / broadcast | delta sync ms "
        "(median) | MB received by each worker (measured) | MB each trainer rank put on the wire (its share) "
        "| busiest rank / all workers received | MB each trainer rank sent over TCP (its FSDP gathers included) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    median: dict[tuple[str, str, str, str], float] = {}
    for name in servers:
        for trainer, path in keys:
            for kind in ("complete", "delta"):
                chosen = [r for r in syncs if (r["server"], _trainer(r), r["path"], r["kind"]) == (name, trainer, path, kind)]
                if chosen:
                    median[(name, trainer, path, kind)] = _median([r["seconds"] for r in chosen])
    for name, server in servers.items():
        workers = server["workers"]
        for trainer, path in keys:
            chosen = [r for r in syncs if (r["server"], _trainer(r), r["path"], r["kind"]) == (name, trainer, path, "complete")]
            if not chosen:
                continue
            seconds = median[(name, trainer, path, "complete")]
            single = median.get(("single", trainer, path, "complete"))
            other = median.get((name, trainer, "broadcast", "complete"))
            ratio = f"{seconds / single:.2f}x" if single else ""
            versus = f"{seconds / other:.2f}x" if other and path == "routed" else ""
            received = [_median([r["received"][w] for r in chosen]) for w in workers]
            shares = [_median([r["shares"][k] for r in chosen]) for k in range(chosen[0]["ranks"])]
            tcp = [_median([r["sent"][f"trainer-rank{k}"] for r in chosen]) for k in range(chosen[0]["ranks"])]
            delta = median.get((name, trainer, path, "delta"))
            lines.append(
                f"| {name} | {trainer} | {path} | {seconds * 1e3:.1f} | {ratio} | {versus} | "
                f"{delta * 1e3 if delta else float('nan'):.1f} | {' / '.join(f'{b / _MB:.1f}' for b in received)} | "
                f"{' / '.join(f'{b / _MB:.1f}' for b in shares)} | {max(shares) / sum(received):.2f} | "
                f"{' / '.join(f'{b / _MB:.1f}' for b in tcp)} |"
            )
    lines += [
        "",
        "| server | worker | MB received per complete sync, broadcast / routed (FSDP2 x 2, measured, median) | "
        "MB of the weights it holds, whole | MB it keeps (its shard) | kept / received, routed | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, server in servers.items():
        shard = next(c for c in checks if c["server"] == name and c["path"] == "routed")
        by_path = {
            path: [r for r in syncs if (r["server"], _trainer(r), r["path"], r["kind"]) == (name, "FSDP2 x 2", path, "complete")]
            for path in PATHS
        }
        for process, tag in server["workers"].items():
            got = {path: _median([r["received"][process] for r in chosen]) for path, chosen in by_path.items()}
            held = shard["workers"][tag]
            lines.append(
                f"| {name} | {tag} ({process}) | {got['broadcast'] / _MB:.2f} / {got['routed'] / _MB:.2f} | "
                f"{held['whole_bytes'] / _MB:.2f} | {held['kept_bytes'] / _MB:.2f} | "
                f"{held['kept_bytes'] / got['routed']:.1%} | {server['peak_rss'][process] / 2**20:.0f} |"
            )
        mine, verdict = _verdict(checks, name)
        notes.append(
            f"- {name}: server up after {server['startup_seconds']:.0f} s; after each trainer's last sync (both paths, "
            f"{len(mine)} runs), {mine[0]['checked']} worker weights compared with the trainer's each time (each cut as "
            f"its worker's loader cuts it), bit for bit: {verdict}."
        )
    notes.append(
        "- MB put on the wire: what `ServerWriter.sent_bytes` counts on each trainer rank (the chunks it sent, trailers "
        "included). Broadcast: rank 0 sends each chunk once to the transfer group; gloo's broadcast then sends it to "
        "every worker over TCP (the TCP column), so the sender's link carries one copy per worker. Routed: each rank "
        "sends its own chunks point to point, each worker only its cut."
    )
    notes.append(
        "- The TCP columns include the FSDP all-gathers between the trainer ranks (each rank receives the other ranks' "
        "shards of every unit): the routed path keeps that gather (every rank holds each full unit while it is handed "
        "on, as before) and adds each rank's share."
    )
    notes.append(
        "- Peak RSS: each worker's `VmHWM` (its high-water mark since it started, the model load included). Every "
        "worker holds a 1 GiB KV cache (`VLLM_CPU_KVCACHE_SPACE=1`) and, with readable weights, its linear weights "
        "unpacked beside vLLM-CPU's packed copy."
    )
    notes.append(
        "- `first`: the first sync of each trainer (the transfer group's handshake, a complete sync), not in the table. "
        "`delta`: after an Adam step; every parameter is trainable, so it sends every tensor as `complete` does. The 2 "
        "cores are shared by the trainer ranks, every server worker and other work on the machine: times vary from "
        "sync to sync."
    )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def multi_worker_sparse_table(rows: list[dict[str, Any]]) -> str:
    """Per server and path, the sparse syncs (after the cold one): their median time, the changed share, one whole copy
    of their patches, and what each worker received (measured) against that copy."""
    servers = {r["server"]: r for r in rows if r["row"] == "server"}
    checks = [r for r in rows if r["row"] == "shards"]
    syncs = [r for r in rows if r["row"] == "sync" and r["rank"] == 0 and r["kind"] == "sparse"]
    lines = [
        "| server | trainer | path | sparse sync ms (median) | changed (median) | MB of the patches, one whole copy "
        "(median) | MB received by each worker (measured) | each worker / one whole copy | MB rank 0 put on the wire |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, server in servers.items():
        for trainer, path in sorted({(_trainer(r), r["path"]) for r in syncs}, key=lambda k: (k[0], PATHS.index(k[1]))):
            chosen = [r for r in syncs if (r["server"], _trainer(r), r["path"]) == (name, trainer, path)]
            if not chosen:
                continue
            if not all(r["sparse"] for r in chosen):
                raise RuntimeError(f"{name} {trainer} {path}: a sync after a step sent no patches: {chosen}")
            whole = _median([r["encoded_bytes"] for r in chosen])
            received = [_median([r["received"][w] for r in chosen]) for w in server["workers"]]
            lines.append(
                f"| {name} | {trainer} | {path} | {_median([r['seconds'] for r in chosen]) * 1e3:.1f} | "
                f"{_median([r['changed_fraction'] for r in chosen]):.2%} | {whole / _MB:.3f} | "
                f"{' / '.join(f'{b / _MB:.3f}' for b in received)} | {' / '.join(f'{b / whole:.2f}' for b in received)} "
                f"| {_median([r['shares'][0] for r in chosen]) / _MB:.3f} |"
            )
        mine, verdict = _verdict(checks, name)
        notes.append(
            f"- {name}: after each trainer's last sync (both paths, {len(mine)} runs), {mine[0]['checked']} worker "
            f"weights compared with the trainer's (each cut as its worker's loader cuts it), bit for bit: {verdict}."
        )
    notes.append(
        f"- Each sparse sync follows one Adam step at learning rate {SPARSE_LR} (`SyncConfig(sparse=True)`); the cold "
        "sync before them (complete) is not in the table. One whole copy: the sync's patches encoded "
        "(`SparseFigures.encoded_bytes`), what a broadcast sends every worker. Measured: the kernel's per-socket "
        "counters of each worker process around the sync (`ss -tinp`). Routed: rank 0 sends each worker only the "
        "changes inside its cut; where no worker holds a cut (`dp2`: replicas of one worker each), the writer "
        "broadcasts the patches, as the `broadcast` path does."
    )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of " + ", ".join(SERVERS))
    parser.add_argument(
        "--trainers", default=",".join(f"{b}x{n}" for b, n in TRAINERS), help="comma-separated BACKENDxRANKS"
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--sparse", action="store_true", help="sparse syncs after small steps (multi-worker-sparse-cpu.md)"
    )
    args = parser.parse_args(argv)
    for name, value in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(name, value)
    import vllm

    trainers = tuple((b, int(n)) for b, n in (t.split("x") for t in args.trainers.split(",")))
    rows = multi_worker_rows(args.reps, tuple(args.servers.split(",")), trainers, args.sparse)
    machine = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other work), torch {torch.__version__}, vLLM "
        f"{vllm.__version__}; {SPEC_NAME} (Qwen2: hidden {SPEC.hidden_size}, {SPEC.num_hidden_layers} layers, "
        f"{SPEC.num_attention_heads} heads, {SPEC.num_key_value_heads} KV heads, vocabulary {SPEC.vocab_size}, tied); "
        f"gloo trainer ranks ({', '.join(f'{b.upper()} x {n}' for b, n in trainers)}), the library's server writer, "
        f"gloo weight transfer, broadcast and routed{', sparse syncs' if args.sparse else ''}; docs/server.md's CPU server "
        "commands (bf16; single: the tensor-parallel one without its parallel flag and CPU binding), readable weights, "
        f"one server at a time; {args.reps} reps, medians"
    )
    if args.sparse:
        _save(args.results, "multi-worker-sparse-cpu", machine, rows, multi_worker_sparse_table)
    else:
        _save(args.results, "multi-worker-cpu", machine, rows, multi_worker_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
