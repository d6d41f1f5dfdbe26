"""Failure behaviour on the real stack: every fault point of `fsdp_sync.faults.FAULT_POINTS`, injected through the
library's own seam (never its private names) on one rank of a real TRL GRPO job with the mixin and real vLLM engines
(in-process, or a real server), FSDP1 and FSDP2, 2 and 3 gloo ranks; and a random-fault soak.

For every injected fault: the fault fired where it was armed; every rank raised a `SyncError` (the failing rank its
own type, the others `RemoteSyncError`) naming the failing rank and the stage the fault model declares, within the
bound of docs/failures.md; every engine weight then holds its previous or its new value (never a third:
finite, no placeholder), checked weight by weight against what the error says; and the mixin's next sync (before the
next generation) is bit-exact, as is every later one. The measured times go to docs/failures.md's fault table
(`python -m benchmarks.faults`; `tests/unit/test_fault_model.py` checks it against `FAULT_POINTS` and
`benchmarks/results/faults.json`, which these tests write with FSDP_VLLM_SYNC_RECORD_FAULTS=1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_sync.faults import FAULT_POINTS
from tests.support.dist import free_port
from fsdp_sync._demo.vllm_server import VLLMServerProcess

from .helpers import WRAPPER_FLAG, run_grpo

pytestmark = pytest.mark.e2e

# Every rank raises within this many seconds of the sync's start (docs/failures.md): a failure is learned
# at the next status round, one unit later; the 2-core CI machine runs 2-3 ranks, their engines and a server.
BOUND_S = 10.0
# The points every sync reaches in these jobs, after the first (build, plan), in the order they are injected.
LATER = ["check", "gather.prepare", "gather.launch", "gather.unflatten", "stream.map", "stream.cast", "write",
         "write.finish", "agree.exchange", "agree.outcome"]  # fmt: skip
# The points of the sparse round and of the patches' push (sparse syncs), in the order they are injected.
SPARSE = ["sparse.diff", "sparse.count", "sparse.pack", "sparse.unpack", "write.patches"]
# The points only the rank that pushes reaches in server mode (the others gather, and receive no patches).
SENDER_ONLY = ("write", "write.finish", "write.patches", "sparse.unpack")
# The points after the sender's write: in server mode injected on the last rank (one that writes nothing), so that a
# rank fails after rank 0 wrote the server's weights and before the sync ends.
AFTER_WRITE = ("agree.outcome", "verify")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "faults.json"
# A learning rate at which a few percent of the bf16 values change per step: sparse syncs send patches.
SPARSE_LR = "3e-6"


def _plan(points: list[str], world: int, *, server: bool) -> list[tuple[int, str, int, str]]:
    """(sync, point, rank, where) for each fault: build at sync 0 and plan at the retry (sync 1), then one fault per
    step (odd syncs from 3), each followed by the mixin's clean retry. Ranks rotate; in server mode only rank 0
    writes."""
    faults = [(0, "build", 1 % world, "first"), (1, "plan", 0, "first")]
    for j, point in enumerate(points):
        rank = 0 if server and point in SENDER_ONLY else (j + 1) % world
        if server and point in AFTER_WRITE:
            rank = world - 1
        where = {"gather.launch": "1", "gather.unflatten": "last", "write": "5", "stream.cast": "3"}.get(point, "first")
        faults.append((3 + 2 * j, point, rank, where))
    return faults


def _check_faults(result: Any, faults: list[tuple[int, str, int, str]], backend: str, world: int) -> list[dict]:
    """Every assertion of the module docstring; returns one timing record per (fault, rank)."""
    assert result.returncode == 0, result.log[-6000:]
    assert len(result.ranks) == world, result.log[-3000:]
    timings = []
    for r in result.ranks:
        rank = r["rank"]
        assert r["error"] is None, r["error"]
        assert r["wrapper"][WRAPPER_FLAG[backend]], r["wrapper"]
        failed = {f["sync"]: f for f in r["failed_syncs"]}
        assert sorted(failed) == sorted(sync for sync, *_ in faults), (rank, sorted(failed))
        injected = {i["sync"]: i for i in r["injections"]}
        for sync, point, failing, _ in faults:
            f = failed[sync]
            stage = FAULT_POINTS[point].stage
            assert f["failures"] == [[failing, stage]], (point, f["failures"], f["message"][:600])
            fired = injected[sync]["fired_here"]
            assert fired == ([point] if rank == failing else []), (point, rank, fired)
            assert f["seconds"] < BOUND_S, f"{point}: rank {rank} took {f['seconds']:.1f} s"
            assert f["type"] != "RemoteSyncError" if rank == failing else f["type"] == "RemoteSyncError", (point, f)
            assert f"rank {failing} ({stage})" in f["message"], f["message"][:600]
            assert f["stale"] and not f["report"]["ok"]
            engine = f["engine"]
            assert engine is None or engine["status"] != "undefined", (point, engine)
            assert engine is None or not engine["undefined"], (point, engine)
            if FAULT_POINTS[point].engine == "unchanged":
                assert engine is None or engine["status"] == "unchanged", (point, rank, engine)
            claim = f.get("claim")
            if claim is not None:
                assert claim["problems"] == [], (point, rank, claim["problems"][:5])
                assert claim["counts"]["undefined"] == 0, (point, rank, claim["counts"])
            timings.append({"point": point, "rank": rank, "failing": rank == failing, "seconds": f["seconds"],
                            "type": f["type"], "engine": engine["status"] if engine else None})  # fmt: skip
        checks = r["checks"]
        assert checks, "no successful sync was checked"
        for c in checks:  # the retries and every later sync
            assert c["direct_problems"] == [] and c.get("logits_problems", []) == [], c
            assert c["direct_checked"] > 0
        ok = [rep for rep in r["reports"] if rep["ok"]]
        assert len(ok) == len(checks)
    return timings


def _check_server_versions(result: Any, faults: list[tuple[int, str, int, str]]) -> None:
    """The server's weight version (`/weight_info`, read by the job from outside the library around every sync)
    moved at every sync that succeeded and at no failed one: a failure on any rank, also after rank 0 wrote the
    server's weights, leaves it naming the weights of the last sync that succeeded."""
    main = next(r for r in result.ranks if r["rank"] == 0)
    seen = main["server_versions"]
    assert seen, "the job read no server weight version"
    failed = {sync for sync, *_ in faults}
    assert {v["sync"] for v in seen if not v["ok"]} == failed, seen
    for v in seen:
        if v["ok"]:
            assert v["after"] != v["before"] and v["after"].startswith("fsdp-vllm-sync:"), v
        else:
            assert v["after"] == v["before"], f"the failed sync {v['sync']} moved the server's weight version: {v}"


def _record(name: str, timings: list[dict]) -> None:
    """With FSDP_VLLM_SYNC_RECORD_FAULTS=1: keep the measured times for docs/failures.md's fault table."""
    if os.environ.get("FSDP_VLLM_SYNC_RECORD_FAULTS") != "1":
        return
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[name] = timings
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True))


COLOCATE = [
    pytest.param("fsdp1", 2, ["--verify"], [*LATER, "verify"], id="fsdp1-2ranks-verify"),
    pytest.param("fsdp2", 3, [], LATER, id="fsdp2-3ranks"),
]


@pytest.mark.parametrize("backend, world, extra, points", COLOCATE)
def test_every_fault_point_colocated(backend: str, world: int, extra: list[str], points: list[str], checkpoints,
                                     tmp_path: Path) -> None:  # fmt: skip
    faults = _plan(points, world, server=False)
    args = [arg for sync, point, rank, where in faults for arg in ("--inject", f"{point}:{sync}:{rank}:{where}")]
    steps = 2 + len(points)
    result = run_grpo(checkpoints("qwen2"), tmp_path, backend, "--steps", str(steps), *args, *extra, ranks=world)
    timings = _check_faults(result, faults, backend, world)
    _record(f"colocate-{backend}-{world}", timings)


SERVER = [
    pytest.param("fsdp2", 2, [], LATER, id="fsdp2-2ranks"),
    pytest.param("fsdp1", 3, ["--peft"], ["check", "gather.prepare", "stream.map", "stream.merge", "stream.cast",
                                         "write", "write.finish"], id="fsdp1-3ranks-lora"),  # fmt: skip
]


@pytest.mark.parametrize("backend, world, extra, points", SERVER)
def test_every_fault_point_in_server_mode(backend: str, world: int, extra: list[str], points: list[str], checkpoints,
                                          server: VLLMServerProcess, tmp_path: Path) -> None:  # fmt: skip
    """The same against a real vLLM server (gloo transfer; the session's shared one): the server's weights are read
    back after every failed sync (old or new, by digest) and every successful one (bit-exact). LoRA (FSDP1, 3 ranks)
    runs the merge on the flat strategy, into a bf16 server."""
    model_dir = checkpoints("qwen2")
    faults = _plan(points, world, server=True)
    args = [arg for sync, point, rank, where in faults for arg in ("--inject", f"{point}:{sync}:{rank}:{where}")]
    result = run_grpo(
        model_dir, tmp_path / "job", backend, "--steps", str(2 + len(points)), *args, *extra,
        "--vllm-mode", "server", "--server-url", server.base_url, "--group-port", str(free_port()),
        ranks=world,
    )  # fmt: skip
    timings = _check_faults(result, faults, backend, world)
    _check_server_versions(result, faults)
    _record(f"server-{backend}-{world}", timings)


SPARSE_RUNS = [
    pytest.param("fsdp1", 2, False, id="colocate-fsdp1-2ranks"),
    pytest.param("fsdp2", 3, False, id="colocate-fsdp2-3ranks"),
    pytest.param("fsdp1", 2, True, id="server-fsdp1-2ranks"),
    pytest.param("fsdp2", 2, True, id="server-fsdp2-2ranks"),
]


@pytest.mark.parametrize("backend, world, server_mode", SPARSE_RUNS)
def test_every_sparse_fault_point(backend: str, world: int, server_mode: bool, checkpoints, request,
                                  tmp_path: Path) -> None:  # fmt: skip
    """The sparse round's points and the patches' push, each injected into a sparse sync (every sync after a clean
    retry is sparse again: the retry is complete and takes the snapshot), colocated and against the session's
    server: the same checks as every other point, and every later sync bit-exact."""
    faults = _plan(SPARSE, world, server=server_mode)
    args = [arg for sync, point, rank, where in faults for arg in ("--inject", f"{point}:{sync}:{rank}:{where}")]
    if server_mode:
        server: VLLMServerProcess = request.getfixturevalue("server")
        args += ["--vllm-mode", "server", "--server-url", server.base_url, "--group-port", str(free_port())]
    steps = 3 + len(SPARSE)  # one sparse sync after the last fault's retry
    result = run_grpo(checkpoints("qwen2"), tmp_path, backend, "--sparse", "--lr", SPARSE_LR, "--steps", str(steps),
                      *args, ranks=world)  # fmt: skip
    timings = _check_faults(result, faults, backend, world)
    if server_mode:
        _check_server_versions(result, faults)
    for r in result.ranks:
        ok = [rep for rep in r["reports"] if rep["ok"]]
        assert ok[-1]["sparse"] and ok[-1]["patched_tensors"] > 0, "sparse syncs did not resume after the faults"
    _record(f"{'server' if server_mode else 'colocate'}-sparse-{backend}-{world}", timings)


SOAK = 50


def test_random_fault_soak(checkpoints, tmp_path: Path) -> None:
    """50 faults at random points (of those every sync reaches) on random ranks, seeded, one per step, each followed
    by the mixin's clean retry: every fault fails every rank within the bound with the engine old-or-new, and every
    successful sync is bit-exact."""
    result = run_grpo(checkpoints("qwen2"), tmp_path, "fsdp2", "--soak", str(SOAK), "--seed", "2026", "--lr", "0.01")
    assert result.returncode == 0, result.log[-6000:]
    plan = {i["sync"]: i for i in result.ranks[0]["injections"]}
    assert len(plan) == SOAK
    faults = [(sync, i["point"], i["ranks"][0], i["where"]) for sync, i in sorted(plan.items())]
    timings = _check_faults(result, faults, "fsdp2", 2)
    points = {point for _, point, _, _ in faults}
    print(f"soak: {SOAK} faults over {len(points)} points; slowest rank to fail: "
          f"{max(t['seconds'] for t in timings) * 1000:.0f} ms")  # fmt: skip
    _record("soak-colocate-fsdp2-2", timings)


def test_verify_catches_a_weight_changed_behind_the_sync_and_names_what_it_cannot_see(checkpoints, tmp_path) -> None:
    """`verify=True` on an engine whose linear weights vLLM-CPU has repacked away (no readable-weights patch): the
    weights it can see are checked, the hidden ones reported as unverifiable by name; a norm weight changed in the
    engine right after the push of sync 1 (rank 0) fails that sync on every rank; the mixin's retry is clean."""
    norm = "model.norm.weight"
    result = run_grpo(
        checkpoints("qwen2"), tmp_path, "fsdp2", "--verify", "--tamper-engine", f"{norm}:1", check=False
    )
    assert result.returncode == 0, result.log[-6000:]
    for r in result.ranks:
        assert r["wrapper"]["is_fsdp2"]
        (failed,) = r["failed_syncs"]
        assert failed["sync"] == 1 and failed["failures"] == [[0, "verify"]], failed
        assert failed["type"] == ("VerifyError" if r["rank"] == 0 else "RemoteSyncError")
        assert norm in failed["message"]
        ok = [rep for rep in r["reports"] if rep["ok"]]
        assert len(ok) == 2  # sync 0 and the retry
        for rep in ok:  # every rank verifies its own engine
            assert rep["verified"] > 0 and rep["unverifiable"] > 0, rep
        print(f"verify: rank {r['rank']}: {ok[0]['verified']} checked, {ok[0]['unverifiable']} unverifiable, "
              f"{ok[0]['verify_seconds'] * 1000:.1f} ms")  # fmt: skip
    assert "the engine hides it (repacked to size 0" in result.log
    assert "qkv_proj.weight" in result.log


def test_a_rank_failing_in_the_last_collectives_of_a_server_sync(
    checkpoints, server: VLLMServerProcess, tmp_path: Path
) -> None:
    """The commit point (issue 47), GRPOTrainer in server mode, FSDP1, 2 ranks: rank 1's
    `torch.distributed.monitored_barrier` raises (injected from outside the library, `tests.support.outside_faults`)
    in the agreement before the last of sync 2 (the push's: rank 0 has written the server's weights, not stamped
    them) and in the last agreement of sync 4 (after rank 0 stamped the server). Sync 2: nothing moves, every rank's
    error is not landed, rank 0's names the version the server still serves. Sync 4: every rank raises it as landed;
    the server's version moved, and rank 0's error names exactly the version the server then says it holds. Every
    sync that succeeded (the retries included) is bit-exact and moves the server's version."""
    result = run_grpo(
        checkpoints("qwen2"), tmp_path / "job", "fsdp1", "--steps", "4", "--barrier-fault", "2:1",
        "--barrier-fault", "4:0", "--vllm-mode", "server", "--server-url", server.base_url,
        "--group-port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.log[-6000:]
    for r in result.ranks:
        assert r["error"] is None and r["wrapper"][WRAPPER_FLAG["fsdp1"]], r["error"]
        before, after = r["failed_syncs"]
        assert before["sync"] == 2 and not before["landed"], before
        assert after["sync"] == 4 and after["landed"], after
        for failed in (before, after):
            assert failed["failures"] == [[1, "agree"]] and "injected" in failed["message"], failed
        assert "had committed before the failure" in after["message"] and "committed" not in before["message"]
        assert r["checks"] and all(
            c["direct_problems"] == [] and c["reference_problems"] == [] and c["logits_problems"] == []
            for c in r["checks"]
        ), r["checks"]
        if r["rank"] == 1:
            assert len(r["barrier_faults"]) == 2, r["barrier_faults"]
    main = next(r for r in result.ranks if r["rank"] == 0)
    versions = {v["sync"]: v for v in main["server_versions"]}
    assert versions[2]["after"] == versions[2]["before"], versions[2]
    assert main["failed_syncs"][0]["version"] == versions[2]["before"], main["failed_syncs"][0]
    assert versions[4]["after"] != versions[4]["before"] and versions[4]["after"].startswith("fsdp-vllm-sync:")
    assert main["failed_syncs"][1]["version"] == versions[4]["after"], (main["failed_syncs"][1], versions[4])
    assert main["failed_syncs"][1]["engine"]["status"] == "current", main["failed_syncs"][1]
    for v in main["server_versions"]:
        if v["ok"]:
            assert v["after"] != v["before"] and v["after"].startswith("fsdp-vllm-sync:"), v
    assert len(main["checks"]) == sum(v["ok"] for v in main["server_versions"]) >= 4, main["checks"]
