"""Versions on the real stack: this package's `vllm.general_plugins` entry point in a vLLM without the
weight-transfer API, and server mode with a TRL that cannot take this package's sync.

vLLM runs every plugin function at the start of each of its processes and (0.32) does not catch their errors, so a
plugin that raised would stop every vLLM process where this package is installed, colocated engines included. On a
vLLM without the weight-transfer registries (before 0.28; simulated by removing the names from vLLM's factory
module after vLLM's own modules took theirs), `register()` must not raise, must say in the log what it skipped, and
the colocated engine must generate and take a weight push exactly as without the plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, sys
model_dir = sys.argv[1]
import vllm.v1.worker.gpu_worker  # vLLM's own references to the registries, taken before the names go
import vllm.distributed.weight_transfer.factory as factory
del factory.WeightTransferEngineFactory, factory.WeightTransferTrainerFactory

import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from fsdp_sync.writers.colocate import ColocateWriter

llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
          kv_cache_memory_bytes=32 * 2**20)
params = SamplingParams(max_tokens=8, temperature=0.0)
prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6, 7]}]
before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
# Push the checkpoint's own weights through the colocated writer: the engine must answer as before.
weights = {}
for f in sorted(__import__("pathlib").Path(model_dir).glob("*.safetensors")):
    weights.update(load_file(str(f)))
writer = ColocateWriter(llm)
writer.write(iter(sorted(weights.items())))
writer.finish()
after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
print("RESULT " + json.dumps({"before": [list(t) for t in before], "after": [list(t) for t in after],
                              "pushed": len(weights)}))
"""


def test_plugin_on_a_vllm_without_weight_transfer_api_leaves_the_colocated_engine_working(
    checkpoints, tmp_path: Path
) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(checkpoints("qwen2"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["before"] == result["after"] and all(result["before"]), result
    assert result["pushed"] > 0
    assert "weight-transfer backends not registered" in log, log[-4000:]
    assert "gloo (engine): this vLLM has no WeightTransferEngineFactory" in log
    assert "gloo (trainer): this vLLM has no WeightTransferTrainerFactory" in log


def test_server_mode_with_a_trl_that_speaks_trl_vllm_serve_is_refused_on_every_rank(
    checkpoints, tmp_path: Path
) -> None:
    """TRL up to 1.10 generates through `trl vllm-serve`'s own routes, which have no weight-transfer API (measured
    with TRL 0.29 against vLLM's server: its generation requests answered 404, after the first sync). The mixin
    refuses such a trainer in server mode when it is built, on every rank, before the server is contacted."""
    from fsdp_sync.compat.trl_api import server_mode_problem
    from tests.support.dist import free_port

    from .helpers import run_grpo

    if server_mode_problem() is None:
        pytest.skip("this TRL talks to vLLM's server (the trl-0.29 leg runs the refusal)")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the refusal must come before any request
    result = run_grpo(checkpoints("qwen2"), tmp_path, "fsdp2", "--vllm-mode", "server", "--server-url", url,
                      "--server-timeout", "5", check=False)  # fmt: skip
    assert result.returncode != 0 and len(result.ranks) == 2, result.log[-4000:]
    for r in result.ranks:
        e = r["error"]
        assert e["type"] == "UnsupportedSetupError" and e["stage"] == "construct", e
        assert "trl vllm-serve" in e["message"] and "TRL 1.11" in e["message"], e["message"]
        assert e["seconds"] < 5, "refused before waiting for the server"


def test_sparse_syncs_on_this_vllm_patch_where_it_can_and_say_why_not_where_it_cannot(
    checkpoints, tmp_path: Path
) -> None:
    """`SyncConfig(sparse=True)` on every vLLM of the matrix: where vLLM has `load_checkpoint_weight_patches` (0.32)
    the syncs after the first send patches; where it has none (0.28-0.31) the log says so once and every sync sends
    whole tensors. Bit-exact after every sync either way (FSDP2, 2 gloo ranks, the colocated CPU engine)."""
    from fsdp_sync.compat.patch_api import patch_loader

    from .helpers import assert_synced_every_time, run_grpo

    result = run_grpo(checkpoints("qwen2"), tmp_path, "fsdp2", "--sparse", "--lr", "3e-6", "--steps", "3")
    ranks = assert_synced_every_time(result, "fsdp2", steps=3, generations_change=False)
    sparse = [[rep["sparse"] for rep in r["reports"]] for r in ranks]
    if patch_loader() is not None:
        assert all(kinds == [False, True, True] for kinds in sparse), sparse
    else:
        assert all(not any(kinds) for kinds in sparse), sparse
        assert "this vLLM has no load_checkpoint_weight_patches" in result.log
