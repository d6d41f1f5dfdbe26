"""Faults of a vLLM server process between a job's syncs, asked of the process that owns the server (tests only).

The server process belongs to the test (`VLLMServerProcess`), the syncs to the job's ranks, so the job asks and the
test acts, through files in the job's output folder: before or after a chosen sync, rank 0 writes
`server-request-<n>.json` (`{"action": ...}`), and every rank waits for `server-done-<n>.json` before it goes on.
`ServerActor` (the test's side) performs each request on its server: `kill` (SIGKILL of the server's whole process
group: a crash), `start` (again on the same port, from the same checkpoint), `restart` (both), `stop` (SIGSTOP: a
stalled server, its sockets still accepting), `cont` (SIGCONT, then until it answers `/health`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from fsdp_sync._demo.vllm_server import VLLMServerProcess

__all__ = ["ACTIONS", "ServerActions", "ServerActor"]

ACTIONS = ("kill", "start", "restart", "stop", "cont")
_POLL_S = 0.05


def _write_whole(path: Path, record: dict[str, object]) -> None:
    """Write `record` so that a reader polling for `path` never sees it part-written (a file renamed into place).

    NOTE: the other side polls for the file's existence and reads it at once; written in place, it was once read
    empty (a rank's JSONDecodeError, then the other rank waiting for it at the next sync).
    """
    part = path.with_suffix(".part")
    part.write_text(json.dumps(record))
    part.replace(path)


class ServerActions:
    """The job's side: the actions planned around its syncs (`--server-action ACTION:SYNC:WHEN`).

    Args:
        specs: `ACTION:SYNC:WHEN` entries; WHEN is `before` (the sync starts after it) or `after` (after the sync
            returned or raised, before the job goes on).
        out_dir: the job's output folder (shared with the test).
        rank: this rank (rank 0 asks; every rank waits).
        timeout_s: how long to wait for the test to act (a server start takes 25-60 s on a 2-core machine).
    """

    def __init__(self, specs: list[str], out_dir: str | Path, rank: int, *, timeout_s: float = 600.0) -> None:
        self.plan: dict[tuple[int, str], list[str]] = {}
        for spec in specs:
            action, sync, when = spec.split(":")
            if action not in ACTIONS or when not in ("before", "after"):
                raise ValueError(f"--server-action {spec}: ACTION is one of {ACTIONS}, WHEN 'before' or 'after'")
            self.plan.setdefault((int(sync), when), []).append(action)
        self.out = Path(out_dir)
        self.rank = rank
        self.timeout_s = timeout_s
        self.asked = 0
        self.done: list[dict[str, object]] = []

    def run(self, sync: int, when: str) -> None:
        """Ask for the actions planned at (`sync`, `when`) and wait until the test has performed them."""
        for action in self.plan.get((sync, when), []):
            n, self.asked = self.asked, self.asked + 1
            if self.rank == 0:
                _write_whole(self.out / f"server-request-{n}.json", {"action": action})
            done = self.out / f"server-done-{n}.json"
            deadline = time.monotonic() + self.timeout_s
            while not done.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test did not perform server action {action!r} within {self.timeout_s} s")
                time.sleep(_POLL_S)
            self.done.append({"sync": sync, "when": when, "action": action, **json.loads(done.read_text())})


class ServerActor:
    """The test's side: performs the requests a job writes into `out_dir` on `server`, in a thread, while the job
    runs (`with ServerActor(server, out_dir): run the job`)."""

    def __init__(self, server: VLLMServerProcess, out_dir: str | Path) -> None:
        self.server = server
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="server-actor", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> ServerActor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        # Never leave the server stopped or dead: others may share it.
        self.server.resume()
        if not self.server.running:
            self.server.start()

    def _serve(self) -> None:
        n = 0
        while not self._stop.is_set():
            request = self.out / f"server-request-{n}.json"
            if not request.exists():
                time.sleep(_POLL_S)
                continue
            action = json.loads(request.read_text())["action"]
            started = time.monotonic()
            try:
                self._act(action)
            except Exception as e:  # noqa: BLE001 - reported by the test; the job waits for the done file
                self.errors.append(f"{action}: {type(e).__name__}: {e}")
            done = {"seconds": time.monotonic() - started, "at": time.time()}
            _write_whole(self.out / f"server-done-{n}.json", done)
            n += 1

    def _act(self, action: str) -> None:
        match action:
            case "kill":
                self.server.kill()
            case "start":
                self.server.start()
            case "restart":
                self.server.kill()
                self.server.start()
            case "stop":
                self.server.pause()
            case "cont":
                self.server.resume()
                self.server.wait_until_healthy()
            case _:
                raise ValueError(f"unknown server action {action!r}; valid: {ACTIONS}")
