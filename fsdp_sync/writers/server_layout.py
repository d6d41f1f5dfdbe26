"""What a server says of its weights, for a server writer's plan and `verify`: its architectures, its parameters'
digests per worker (`/weight_checker`), how each tensor-parallel worker cuts each weight, which weights can take
sparse patches in place. Part of `ServerWriter` (a mixin of it): its client and checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_sync.compat.engine_api import EngineLayout, engine_naming_for_architectures, worker_digests

from ..server_client import ServerConfigError, ServerRequestError, ServerRouteMissing

if TYPE_CHECKING:
    from ..server_client import ServerClient
    from .server_transports import Transport

__all__ = ["ServerLayout"]

logger = logging.getLogger(__name__)


class ServerLayout:
    """The engine-reading half of `ServerWriter` (which holds the state named below)."""

    client: ServerClient | None
    backend: str | None
    transport: Transport
    checkpoint_dir: str
    # The server's per-parameter digests as this plan read them (`engine_layout`), for the plan's other questions
    # (`sparse_refusal`, `patch_refusals`); dropped when the plan is announced (`prepare`).
    _plan_checksums: dict[str, str] | None

    def _architectures(self) -> list[str]:
        """The `architectures` of the server's checkpoint (empty where its config cannot be read here)."""
        config = Path(self.checkpoint_dir) / "config.json"
        return (json.loads(config.read_text()).get("architectures") if config.is_file() else None) or []

    def engine_layout(self) -> EngineLayout:
        # NOTE: the server's parameter names come with its digests (the only route that lists them); read once per
        # plan, when the sync sends only what changed or verifies.
        assert self.client is not None
        naming = engine_naming_for_architectures(self._architectures())
        try:
            checksums = self._plan_checksums = self.client.weight_checksums()
        except ServerRouteMissing as e:
            logger.warning(
                "weight sync: %s, so its parameters cannot be listed; delta syncs send whole decoder layers (every "
                "tensor of a layer that holds anything that can change), and SyncConfig(verify=True) is refused",
                e,
            )
            refused = ServerConfigError(
                f"SyncConfig(verify=True) compares the server's own weight digests with what was sent, but {e}. "
                "Upgrade the server's vLLM, or sync without verify."
            )
            refused.__cause__ = e
            return EngineLayout(naming, None, refused)
        modules = frozenset(key.rsplit(":", 1)[-1].rpartition(".")[0] for key in checksums)
        return EngineLayout(naming, modules, shard_rules=self._shard_rules(checksums))

    def _shard_rules(self, checksums: dict[str, str]) -> dict[str, dict[str, Any]] | None:
        """Each worker's cut of every weight, where the server shards them (None: it does not, or cannot say why
        not: then `verify` reports the split weights as unverifiable, by name)."""
        assert self.client is not None
        if not worker_digests(checksums)[1]:
            return None
        try:
            return self.client.shard_rules()
        except (ServerConfigError, ServerRequestError) as e:
            logger.warning(
                "weight sync: the server shards weights over its workers but cannot say how (%s); "
                "SyncConfig(verify=True) reports its split weights as unverifiable",
                e,
            )
            return None

    def engine_digests(self) -> tuple[dict[str, dict[str, str]], bool]:
        assert self.client is not None
        return worker_digests(self.client.weight_checksums())

    def sparse_refusal(self) -> str | None:
        if not self.transport.carries_patches:
            return (
                f"the server's {self.backend!r} weight-transfer backend takes whole tensors; sparse syncs to a server "
                "use this package's 'gloo' backend (vLLM's sparse_nccl backend is not driven yet): restart it with "
                "--weight-transfer-config '{\"backend\": \"gloo\"}' and FSDP_VLLM_SYNC_SPARSE=1 "
                "(python -m fsdp_sync.server_command --sparse prints the command)"
            )
        try:
            self._checksums()
        except ServerRouteMissing as e:
            return (
                f"{e}, so it cannot say which of its weights can be patched in place: serve with vLLM 0.32 or newer "
                "for sparse syncs"
            )
        return None

    def _checksums(self) -> dict[str, str]:
        """The server's per-parameter digests: those this plan read already, else read now.

        NOTE: a plan asks three questions of them (names, sparse support, packed-away weights); each read makes the
        server hash every weight, so they are read once per plan. `engine_digests` (verify) always reads anew.
        """
        assert self.client is not None
        if self._plan_checksums is None:
            self._plan_checksums = self.client.weight_checksums()
        return self._plan_checksums

    def patch_refusals(self) -> dict[str, str]:
        from fsdp_sync.transfer.plugin import SPARSE_ENV

        from ..digest import EMPTY_DIGEST

        refused: dict[str, str] = {}
        for key, digest in self._checksums().items():
            if digest == EMPTY_DIGEST:
                refused[key.rsplit(":", 1)[-1]] = (
                    f"the server packed it away (vLLM-CPU); start the server with {SPARSE_ENV}=1 to keep it"
                )
        return refused
