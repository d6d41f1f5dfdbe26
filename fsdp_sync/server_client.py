"""The vLLM server routes a weight sync uses, each call bounded in time and never retried; every error is a
`SyncError` (raised on every rank when the trainer is built, or agreed during a sync).

Why not TRL's `VLLMClient` for these: it retries POSTs up to 5 times with exponential back-off (about a minute against
a dead server) and builds NCCL only. A sync must fail within a known time, on every rank. The four weight-update
calls come from vLLM's own `HTTPVLLMWeightSyncClient` (the `VLLMWeightSyncClient` protocol its trainer engines
drive); this subclass adds the routes around them and error messages that carry the server's answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from fsdp_sync.compat.server_api import ROUTE_SINCE, ServerInfo, parse_server_info

from .errors import SyncError

__all__ = [
    "ServerClient",
    "ServerConfigError",
    "ServerNoAnswerError",
    "ServerRequestError",
    "ServerRouteMissing",
    "ServerUnavailableError",
]

logger = logging.getLogger(__name__)


class ServerUnavailableError(SyncError):
    """The vLLM server cannot be reached (not started, wrong address, or it died)."""


class ServerNoAnswerError(ServerUnavailableError):
    """The vLLM server took the request but did not answer in time (stopped, hung, or overloaded)."""


class ServerConfigError(SyncError):
    """The server runs, but not in a way a weight sync can use (no weight-transfer backend, no dev routes, ...)."""


class ServerRequestError(SyncError):
    """The server answered a weight-sync request with an error; the message carries its answer."""


class ServerRouteMissing(ServerConfigError):
    """The server runs with its development routes, but its vLLM version has no such route (an older vLLM)."""


class ServerClient(HTTPVLLMWeightSyncClient):
    """Talks to one vLLM server (`vllm serve` / `trl vllm-serve`, started with `VLLM_SERVER_DEV_MODE=1`).

    Args:
        base_url: e.g. `http://127.0.0.1:8000`.
        timeout: seconds each request may take (a weight update's `/update_weights` lasts the whole transfer).

    Attributes:
        deadline: `time.monotonic()` by which every request must be answered (the sync's own bound, set for each
            sync by the writer; None: `timeout` alone).
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        super().__init__(base_url, timeout=timeout)
        self.deadline: float | None = None

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        import requests

        url = f"{self.base_url}/{path}"
        bound = timeout or self.timeout
        by_deadline = self.deadline is not None and self.deadline - time.monotonic() < bound
        if by_deadline:
            # NOTE: never 0 (requests refuses it); a passed deadline leaves 1 ms.
            bound = max(self.deadline - time.monotonic(), 1e-3)  # type: ignore[operator]
        try:
            response = requests.request(method, url, timeout=bound, **kwargs)
        except requests.exceptions.Timeout as e:
            why = " (what was left of the sync's bound, SyncConfig.sync_timeout_s)" if by_deadline else ""
            raise ServerNoAnswerError(
                f"the vLLM server at {self.base_url} did not answer {method} /{path} within {bound:.1f} s{why}"
            ) from e
        except requests.exceptions.ConnectionError as e:
            raise ServerUnavailableError(f"the vLLM server at {self.base_url} cannot be reached ({method} /{path})") from e
        if response.status_code == 404 and path != "health":
            raise self._missing(path)
        if response.status_code != 200:
            raise ServerRequestError(
                f"the vLLM server at {self.base_url} answered {method} /{path} with HTTP {response.status_code}: "
                f"{response.text[:2000]}"
            )
        return response.json() if response.content else None

    def _missing(self, path: str) -> ServerConfigError:
        """The error for a route the server does not have: its development routes are off, or (when `/server_info`,
        itself a development route, answers) its vLLM is older than the route."""
        if path != "server_info":
            try:
                self._request("GET", "server_info", params={"config_format": "json"}, timeout=min(self.timeout, 10.0))
                version = self._request("GET", "version", timeout=min(self.timeout, 10.0)).get("version", "unknown")
            except (ServerConfigError, ServerRequestError, ServerUnavailableError, AttributeError):
                pass
            else:
                since = ROUTE_SINCE.get(path)
                return ServerRouteMissing(
                    f"the vLLM server at {self.base_url} runs vLLM {version}, which has no route /{path}"
                    + (f" (it came with vLLM {since})" if since else "")
                )
        return ServerConfigError(
            f"the vLLM server at {self.base_url} has no route /{path}: start it with VLLM_SERVER_DEV_MODE=1 "
            "(the weight-update routes are development routes)"
        )

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        self._request("POST", path, json=json)

    def wait_until_up(self, total_timeout: float, interval: float = 1.0) -> None:
        """Poll `/health` until it answers 200 (a server still loading its model answers nothing).

        Raises:
            ServerUnavailableError: no healthy answer within `total_timeout` seconds.
        """
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                self._request("GET", "health", timeout=min(self.timeout, 10.0))
                return
            except (ServerUnavailableError, ServerRequestError) as e:
                if time.monotonic() >= deadline:
                    raise ServerUnavailableError(
                        f"the vLLM server at {self.base_url} was not up after {total_timeout:.0f} s ({e}). Start it "
                        "first, or raise the trainer's vllm_server_timeout."
                    ) from e
            time.sleep(interval)

    def server_info(self) -> ServerInfo:
        return parse_server_info(self._request("GET", "server_info", params={"config_format": "json"}))

    def world_size(self) -> int:
        """Number of vLLM workers (tensor x pipeline x data parallel), each a rank of the transfer group."""
        return int(self._request("GET", "get_world_size")["world_size"])

    def reset_prefix_cache(self) -> None:
        self._request("POST", "reset_prefix_cache")

    def engine_fixes(self) -> frozenset[str]:
        """The reload fixes every worker of the server applies to every weight-transfer engine (this package's
        plugin, installed in the server's environment, adds them; the question `engine_fixes` of
        `fsdp_sync.transfer.questions`); empty where the server cannot say (this package is not installed there, or
        the development routes are off)."""
        from .transfer.questions import ask

        try:
            answers = ask(self, "engine_fixes")
        except (ServerConfigError, ServerRequestError):
            return frozenset()
        workers = [set(a["answer"]) for a in answers]
        return frozenset(set.intersection(*workers)) if workers else frozenset()

    def model_names(self) -> list[str]:
        """The model names the server serves (`/v1/models`: its model and the adapter versions it serves)."""
        answer = self._request("GET", "v1/models")
        return [str(m["id"]) for m in (answer or {}).get("data", [])]

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Run a method of vLLM's workers on every worker (`/collective_rpc`, the development route); the answers
        of the first data-parallel replica's workers only (vLLM 0.32's `DPLBAsyncMPClient.call_utility_async`).
        The route `fsdp_sync.transfer.questions.ask` asks the workers through; nothing else calls it."""
        answer = self._request("POST", "collective_rpc", json={"method": method, "args": args or []})
        return list((answer or {}).get("results", []))

    def shard_rules(self) -> dict[str, dict[str, Any]]:
        """Each worker's cut of every weight (`compat.tp_shards.shard_rules`, the question `shard_rules` of
        `fsdp_sync.transfer.questions`), by the worker's place in its replica (`compat.engine_api.worker_place`:
        `pp0:pcp0:tp1`).

        NOTE: answered by the first data-parallel replica's workers only; the other replicas' workers at the same
        place hold the same cuts.

        Raises:
            ServerConfigError, ServerRequestError: the server cannot say (this package is not installed there, or
                the development routes are off).
        """
        from fsdp_sync.compat.engine_api import worker_place

        from .transfer.questions import ask

        return {worker_place(a["worker"]): a["answer"] for a in ask(self, "shard_rules")}

    def pause(self) -> None:
        """Stop scheduling generation; requests in flight are kept, not aborted (vLLM's `/pause?mode=keep`, what
        TRL's async trainer asks for), and go on from where they were at `resume`."""
        self._request("POST", "pause", params={"mode": "keep"})

    def resume(self) -> None:
        """Schedule generation again after `pause` (vLLM's `/resume`)."""
        self._request("POST", "resume")

    def weight_version(self, timeout: float | None = None) -> str:
        """The version of the weights the server holds (vLLM's `/weight_info`; `"default"` after start-up).

        Args:
            timeout: the bound on this request (default: the client's).

        Raises:
            ServerRouteMissing: the server has no weight versions (the route came with vLLM's weight-transfer API).
            ServerRequestError: the server's data-parallel engines disagree (vLLM raises), or another error answer.
        """
        return str(self._request("GET", "weight_info", timeout=timeout)["weight_version"])

    def update_weight_version(self, version: str) -> None:
        """Give the weights the server holds this version (vLLM's `/update_weight_version`)."""
        self._request("POST", "update_weight_version", json={"new_version": version})

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of every engine parameter, keyed `dp0:pp0:pcp0:tp0:<engine name>` (vLLM's `/weight_checker`).

        Raises:
            ServerRouteMissing: the server's vLLM is older than the route (0.32).
        """
        return dict(self._request("POST", "weight_checker", json={"action": "checksum"})["checksums"])
