"""Recovery of the server transport, unit level: `ServerWriter` and this package's gloo backend on both sides, over a
real gloo group on 127.0.0.1, with the server's control plane and its one worker standing in threads of this process
(`ThreadServer`). The end-to-end tests against real vLLM server processes (killed and restarted, stopped and resumed)
are in `tests/e2e/test_recovery.py`.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.compat.names import NameRules
from fsdp_sync.config import SyncConfig
from fsdp_sync.errors import SyncError
from fsdp_sync.assemble import policy_for
from fsdp_sync.sync.pipeline import WeightSync
from fsdp_sync.server_client import ServerRequestError, ServerRouteMissing, ServerUnavailableError
from tests.support.dist import free_port
from fsdp_sync.transfer import gloo
from fsdp_sync.writers.server import ServerWriter

from .test_server_writer import TwoTensorGatherer, _info


class ThreadServer:
    """The routes a sync calls on a vLLM server, answered in this process; its worker is the real worker side of the
    gloo backend (the model only records what it is given). `restart()` replaces the worker with a fresh one, as a
    restarted server has: no transfer joined, weight version "default". `stalled` makes every request wait until it
    is cleared, as a server stopped with SIGSTOP does; a request that waits longer than the client's timeout fails as
    an HTTP client's read timeout does."""

    base_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.stalled = threading.Event()
        self.timeout = 5.0
        self.restart()

    def restart(self) -> None:
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.extend((n, t.clone()) for n, t in weights))
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
        )
        self.worker = gloo.GlooWeightTransferEngine(None, config, torch.device("cpu"), model)  # type: ignore[arg-type]
        self.version = "default"
        self.active = False

    def _answer(self, path: str) -> None:
        started = time.monotonic()
        while self.stalled.is_set():
            if time.monotonic() - started > self.timeout:
                raise ServerUnavailableError(f"the vLLM server at {self.base_url} did not answer POST /{path}")
            time.sleep(0.01)

    def world_size(self) -> int:
        return 1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._answer("init_weight_transfer_engine")
        self.worker.init_transfer_engine(gloo.GlooWorkerInitInfo(**init_info))

    def start_weight_update(self) -> None:
        self._answer("start_weight_update")
        if self.active:
            raise ServerRequestError("HTTP 500: start_weight_update called while a weight update is already active")
        self.active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._answer("update_weights")
        try:
            self.worker.receive_weights(gloo.GlooUpdateInfo(**update_info))
        except RuntimeError as e:
            self.active = False
            raise ServerRequestError(f"HTTP 500: {e}") from e

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._answer("finish_weight_update")
        if not self.active:
            raise ServerRequestError("HTTP 500: finish_weight_update called without a matching start_weight_update")
        self.active = False
        if weight_version is not None:
            self.version = weight_version

    def reset_prefix_cache(self) -> None:
        self._answer("reset_prefix_cache")

    def weight_version(self, timeout: float | None = None) -> str:
        self._answer("weight_info")
        return self.version

    def update_weight_version(self, version: str) -> None:
        self._answer("update_weight_version")
        self.version = version

    def weight_checksums(self) -> dict[str, str]:
        return {f"dp0:pp0:pcp0:tp0:{name}": "0" for name in ("b.weight", "a.index")}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _served(tmp_path: Path, config: SyncConfig | None = None) -> tuple[WeightSync, ThreadServer, int]:
    save_file(
        {"b.weight": torch.zeros(2, 3, dtype=torch.bfloat16), "a.index": torch.zeros(4, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    server = ThreadServer()
    port = free_port()
    writer = ServerWriter(
        server, _info(), group_port=port, checkpoint_dir=str(tmp_path), buffer_bytes=1024, timeout_s=5  # type: ignore[arg-type]
    )
    return WeightSync(TwoTensorGatherer(), writer, config, rules=NameRules(), policy=policy_for), server, port


@pytest.fixture
def served(tmp_path: Path) -> tuple[WeightSync, ThreadServer, int]:
    return _served(tmp_path)


def _sent(server: ThreadServer) -> dict[str, torch.Tensor]:
    return dict(server.loaded)


def test_a_restarted_server_costs_one_failed_sync_and_the_next_connects_at_once(served) -> None:
    """Regression (issue 27): after a server restart, the failed sync left the previous transfer's rendezvous store
    listening on the group port for as long as anything held the failed round (here the caller keeps the error, as
    a training loop's `except ... as e` or a log handler does), and the next sync failed with EADDRINUSE. The failed
    transfer is closed at once: the port is free when the error reaches the caller, and the next sync is complete."""
    sync, server, port = served
    sync.sync()
    assert set(_sent(server)) == {"b.weight", "a.index"}
    server.restart()
    server.loaded.clear()
    with pytest.raises(SyncError) as failed:
        sync.sync()
    assert not _listening(port), "the failed transfer's rendezvous store still listens on the group port"
    report = sync.sync()
    assert failed.value is not None  # kept alive across the next sync on purpose
    assert report.complete
    values = sync.gatherer.values  # type: ignore[attr-defined]
    want = {n.removeprefix("_fsdp_wrapped_module."): t for n, t in values.items()}
    got = _sent(server)
    assert set(got) == set(want)
    assert torch.equal(got["b.weight"], want["b.weight"].bfloat16()) and torch.equal(got["a.index"], want["a.index"])


def test_a_refused_handshake_frees_the_group_port_at_once(served) -> None:
    """The server answers the handshake with an error while the sender waits in the rendezvous: the sender's
    listening store is closed before the error is raised (it used to listen until the rendezvous timed out)."""
    sync, server, port = served

    def refuse(init_info: dict[str, Any]) -> None:
        raise ServerRequestError("HTTP 500: refused")

    server.init_weight_transfer_engine = refuse  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(SyncError, match="refused"):
        sync.sync()
    assert time.monotonic() - started < 4, "the refusal must be raised at once, not after the rendezvous timeout"
    assert not _listening(port)
    abandoned = [t for t in threading.enumerate() if t.name == "fvs-gloo-rendezvous"]
    for thread in abandoned:
        thread.join(timeout=4)
    assert not any(t.is_alive() for t in abandoned), "the abandoned rendezvous must end with its store"


def test_a_server_restarted_between_syncs_is_found_by_its_weight_version(tmp_path: Path, caplog) -> None:
    """Delta syncs stamp each push with a version; a server restarted between two syncs answers "default", so the
    next sync is complete (and connects again) without failing: the weight version alone says the server no longer
    holds the push the delta is relative to."""
    sync, server, _ = _served(tmp_path, SyncConfig(delta=True, delta_check=False))
    assert sync.sync().complete
    stamped = server.version
    assert stamped.startswith("fsdp-vllm-sync:")
    assert not sync.sync().complete, "a delta sync while the server holds the last push"
    assert server.version != stamped, "every push stamps a version of its own"
    server.restart()
    server.loaded.clear()
    with caplog.at_level("WARNING"):
        report = sync.sync()
    assert report.complete
    assert "'default'" in caplog.text and "it was restarted: it holds its checkpoint" in caplog.text
    assert set(_sent(server)) == {"b.weight", "a.index"}
    assert not sync.sync().complete, "delta syncs resume"


def test_a_server_without_weight_versions_keeps_delta_syncs_and_says_so_once(tmp_path: Path, caplog) -> None:
    """A server without `/weight_info`: nothing is stamped or checked, delta syncs go on as before, and the
    trainer's log says once that a restart is then noticed only by a failing connection."""
    sync, server, _ = _served(tmp_path, SyncConfig(delta=True, delta_check=False))

    def missing(*args: Any, **kwargs: Any) -> str:
        raise ServerRouteMissing("the vLLM server runs vLLM 0.27.0, which has no route /weight_info")

    server.weight_version = missing  # type: ignore[method-assign]
    server.update_weight_version = missing  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        reports = [sync.sync() for _ in range(3)]
    assert [r.complete for r in reports] == [True, False, False]
    assert caplog.text.count("keeps no weight version") == 1, caplog.text


def test_a_server_killed_between_syncs_costs_one_failed_sync_and_the_next_connects_again(tmp_path: Path) -> None:
    """The server is gone when a delta sync starts (its weight version cannot be read: the sync fails before
    anything is sent) and back, restarted, before the next: that one is complete (as after any failed sync, so it
    reads no version) and must not push into the transfer to the dead process (regression: it did, and failed
    with "Connection closed by peer")."""
    sync, server, _ = _served(tmp_path, SyncConfig(delta=True, delta_check=False))
    sync.sync()

    def unreachable(timeout: float | None = None) -> str:
        raise ServerUnavailableError(f"the vLLM server at {server.base_url} cannot be reached (GET /weight_info)")

    server.weight_version = unreachable  # type: ignore[method-assign]
    with pytest.raises(SyncError, match="cannot be reached") as failed:
        sync.sync()
    assert failed.value.engine is not None and failed.value.engine.status == "unknown"
    del server.weight_version
    server.restart()
    server.loaded.clear()
    assert sync.sync().complete
    assert set(_sent(server)) == {"b.weight", "a.index"}


def test_engines_that_disagree_on_the_weight_version_make_the_sync_complete(tmp_path: Path, caplog) -> None:
    """vLLM raises on `/weight_info` when its data-parallel engines hold different versions: no single push is what
    the server holds, so that sync is complete, not failed."""
    sync, server, _ = _served(tmp_path, SyncConfig(delta=True, delta_check=False))
    sync.sync()

    def disagree(timeout: float | None = None) -> str:
        raise ServerRequestError("HTTP 500: engines returned different weight versions")

    server.weight_version = disagree  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        assert sync.sync().complete
    assert "do not hold the same weights" in caplog.text
