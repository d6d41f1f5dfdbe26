"""A server writer's adapter syncs (`fsdp_sync.writers.base.AdapterWriter`): the adapter's tensors over the
transfer into every worker's LoRA manager, staged beside the versions the server serves, verified, then published
(`compat/lora_patches.py` on the server's side). Part of `ServerWriter` (a mixin of it): its transfer and client."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fsdp_sync.compat.engine_api import engine_model_class
from fsdp_sync.compat.lora_api import Adapter, EngineLoRA, LoRALimits, engine_lora_of
from fsdp_sync.compat.weight_transfer import plan_source

from ..errors import VerifyError
from ..server_client import ServerConfigError

if TYPE_CHECKING:
    from fsdp_sync.compat.server_api import ServerInfo
    from fsdp_sync.compat.weight_transfer import PlanSource

    from ..server_client import ServerClient
    from .server_transports import Transport

__all__ = ["ServerAdapters"]

logger = logging.getLogger(__name__)


class ServerAdapters:
    """The `AdapterWriter` capability of `ServerWriter` (which holds the state named below)."""

    client: ServerClient | None
    info: ServerInfo
    backend: str | None
    transport: Transport
    checkpoint_dir: str
    _source: PlanSource | None
    _engine: Any
    _round_open: bool
    # The adapter version published last (requests ask for it by name), and the one sent and not yet published.
    _adapter_name: str | None
    _staged_name: str | None

    if TYPE_CHECKING:  # the writer's own

        def _begin_round(self) -> Any: ...

        def _drop_transfer(self) -> None: ...

        def _architectures(self) -> list[str]: ...

    def lora_limits(self) -> LoRALimits | None:
        """From the server's configuration (every rank has it); the target modules are checked by the server before
        it keeps anything."""
        rank = self.info.max_lora_rank
        return LoRALimits(rank, None, None) if rank is not None else None

    def kept_adapter_versions(self) -> int:
        """How many adapter versions the server keeps servable (`FSDP_VLLM_SYNC_ADAPTER_VERSIONS` there; the
        fewest any worker keeps): the question `kept_versions` (`fsdp_sync.transfer.questions`).

        Raises:
            ServerConfigError, ServerRequestError: the server cannot say (without this package installed there, or
                an invalid setting there, named in the server's answer).
        """
        from ..transfer.questions import ask

        assert self.client is not None
        return min(a["answer"] for a in ask(self.client, "kept_versions"))

    def adapter_transport_refusal(self) -> str | None:
        if not self.transport.carries_adapters:
            return (
                f"adapter syncs to a server travel over this package's 'gloo' weight-transfer backend; the server "
                f"uses {self.backend!r} (restart it with --weight-transfer-config '{{\"backend\": \"gloo\"}}')"
            )
        return None

    def base_checkpoint(self) -> str:
        return self.checkpoint_dir

    def load_adapter(self, adapter: Adapter) -> None:
        """Send the adapter's tensors over the transfer; every worker builds it and stages it beside the versions it
        serves (a request naming it is answered 404 until `publish_adapter`)."""
        refusal = self.adapter_transport_refusal()
        if refusal is not None:
            raise ServerConfigError(refusal)
        self._source = self._source or plan_source(())
        self._staged_name = adapter.name
        self._adapter_round(lambda engine: engine.send_adapter(
            list(adapter.tensors.items()),
            {"id": adapter.adapter_id, "name": adapter.name, "config": dict(adapter.config)},
        ))  # fmt: skip

    def publish_adapter(self, adapter: Adapter) -> None:
        """The commit point of an adapter sync: the staged version becomes servable on every worker and in the API
        server's list (the oldest beyond the server's K retired). A publish whose answer was lost is read back from
        the server's list (`/v1/models`): it raises only when the server does not serve the version. This writer's
        first publish retires every version the server served before (another trainer's: a restarted job names its
        versions from v1 again)."""
        try:
            fresh = self._adapter_name is None
            self._adapter_round(lambda engine: engine.publish_adapter(adapter.name, fresh=fresh))
        except Exception as e:
            assert self.client is not None
            try:
                served = adapter.name in self.client.model_names()
            except Exception as asked:  # noqa: BLE001 - the publish's own failure is the one raised
                logger.warning("weight sync: the server's adapters after a failed publish: %s", asked)
                raise e from None
            if not served:
                raise
            logger.warning("weight sync: the publish's request failed (%s), but the server serves %s", e, adapter.name)
        self._adapter_name, self._staged_name = adapter.name, None

    def abandon_adapter(self) -> None:
        """Nothing to send: a staged version is never served, and the next push replaces it on the workers."""
        self._staged_name = None

    def _adapter_round(self, send: Callable[[Any], Any]) -> None:
        """One adapter round over the transfer (`send(engine)`); a failure drops the transfer (set up again at the
        next sync)."""
        try:
            engine = self._begin_round()
            self._round_open = True
            send(engine)
            self._round_open = False
        except Exception:
            self._drop_transfer()
            raise

    def adapter_request(self) -> object | None:
        """The name requests ask for the adapter by (TRL's client sends it as `model`): the version published last."""
        return self._adapter_name

    def adapter_digests(self) -> tuple[dict[str, dict[str, str]], EngineLoRA]:
        """Each worker's digests of the adapter it keeps under the staged version's name, every worker of every
        data-parallel replica (the question `adapter_digests`, answered over the transfer group:
        `fsdp_sync.transfer.questions`); a tensor-parallel worker keeps the whole adapter (vLLM slices it only when
        it activates it).

        Raises:
            VerifyError: a worker keeps no such version.
        """
        from ..transfer.questions import ask

        name = self._staged_name
        assert self.client is not None and self._engine is not None and name is not None, "no adapter was staged"
        try:
            asked = ask(self.client, "adapter_digests", name, transfer=self._engine)
        except Exception:
            # NOTE: a question not answered may leave the group mid-collective: set the transfer up again next sync.
            self._drop_transfer()
            raise
        answers = {a["worker"] or str(i): a["answer"] for i, a in enumerate(asked)}
        missing = [f"worker {w} (it keeps {a.get('kept')})" for w, a in answers.items() if not a.get("held")]
        if missing or not answers:
            raise VerifyError(f"the server keeps no adapter {name} on {', '.join(missing) or 'any worker'}")
        dtypes = sorted({d for a in answers.values() for d in a["dtypes"]})
        if len(dtypes) > 1:
            raise VerifyError(f"the server's workers keep adapter {name} in several dtypes: {dtypes}")
        dtype = dtypes[0] if dtypes else str(self.info.dtype).removeprefix("torch.")
        model_class = engine_model_class(self._architectures())
        engine = engine_lora_of(model_class, getattr(torch, dtype), vocab_size=None, max_positions=None)
        return {w: a["digests"] for w, a in answers.items()}, engine
