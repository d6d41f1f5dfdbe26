"""Server writer: weights go to a separate vLLM server through vLLM's weight-transfer API.

The transport is the one the server was started with (`--weight-transfer-config '{"backend": ...}'`), chosen once:
`nccl` (vLLM's own NCCL trainer engine, what TRL uses; CUDA trainers) or `gloo` (this package's CPU backend,
`fsdp_sync.transfer.gloo`). Both are reached through vLLM's registry of trainer engines and driven through the same
four-call protocol (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`).

Only the main process sends. The tensors are announced from the sync plan (names, engine dtypes, shapes in stream
order), so there is no metadata gather pass as in TRL.

Why rank 0's sends never wait on a collective the other ranks are not in: the sender only sends while it iterates
the sync's stream, and every tensor of that stream comes out of a gather that all ranks run in the same order (the
other ranks drain the same stream). The transfer group is a separate group of the sender and the server's workers;
the trainer's ranks run no collective inside it. After a failed send the sender drains the rest of the stream (so
the gathers complete on every rank) before the ranks agree on the outcome (`fsdp_sync.sync.push.Push.run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlparse

import torch

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
from fsdp_sync.compat.engine_api import (
    EngineLayout,
    engine_model_class,
    engine_naming_for_architectures,
    worker_digests,
)
from fsdp_sync.compat.lora_api import Adapter, EngineLoRA, LoRALimits, engine_lora_of
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch
from fsdp_sync.compat.server_api import ServerInfo
from fsdp_sync.compat.trl_api import ServerAddress
from fsdp_sync.compat.vllm_patches import unfixed_reload_gaps
from fsdp_sync.compat.weight_transfer import PlanSource, plan_source, source_metadata, trainer_transfer_engine
from ..errors import EngineState, SyncError, VerifyError
from ..versions import ServerVersions
from ..server_client import (
    ServerClient,
    ServerConfigError,
    ServerRequestError,
    ServerRouteMissing,
    ServerUnavailableError,
)

if TYPE_CHECKING:
    from ..transfer.staging import StagedTransfer

__all__ = [
    "SUPPORTED_BACKENDS",
    "ServerPushError",
    "ServerResumeError",
    "ServerTransportError",
    "ServerWriter",
    "check_server",
]

logger = logging.getLogger(__name__)


class ServerPushError(SyncError):
    """The server refused or failed a weight update (its HTTP answer is in the message)."""


class ServerTransportError(SyncError):
    """The transfer group itself failed (connection lost, timeout): a network error, not an engine error."""


class ServerResumeError(ServerPushError):
    """The weights were written under a pause, but the server did not resume its generation (`POST /resume`)."""


@dataclass(frozen=True)
class _Transport:
    """How to reach one weight-transfer backend from the trainer.

    Attributes:
        retains_tensors: the trainer engine keeps tensors it was handed until a chunk is complete (NCCL's packed
            producer concatenates a chunk's tensors lazily); gloo copies each into its chunk at once.
        init_fields: backend-specific fields of the trainer init info, from (master address, port, world size,
            buffer bytes, timeout, the sync's deadline).
        requires_cuda: the backend runs only on a CUDA trainer.
        partial_round: what the server's engine holds after a round that ended part-way.
        aborts_round: the backend can end a round part-way on the server's side (gloo's abort marker), so a failure
            of the trainer's own stream leaves the transfer usable; without it (vLLM's NCCL backend) the round is
            completed with placeholder tensors, which the server then holds (reported as undefined).
        patches_loaders: the backend's worker side applies this package's fixes of vLLM's loaders
            (`compat.vllm_patches`, e.g. gpt-oss's); without them, the tensors those fixes cover are refused.
        bounded: the trainer engine ends its own waits by the sync's deadline (`bound`); vLLM's NCCL engine keeps
            NCCL's bound on its collectives (the HTTP answers are bounded by the client either way).
        stages: the backend can receive an update into the server's host memory while the engine keeps generating
            and write it later (gloo's staged rounds), so a writer that pauses the server pauses it for the write
            alone; without it (NCCL) the server is paused for the whole send.
    """

    retains_tensors: bool
    init_fields: Callable[[str, int, int, int, float, float | None], dict[str, Any]]
    requires_cuda: bool
    partial_round: EngineState
    aborts_round: bool
    patches_loaders: bool
    bounded: bool
    stages: bool


_TRANSPORTS: dict[str, _Transport] = {
    "nccl": _Transport(
        retains_tensors=True,
        init_fields=lambda address, port, world, buffer, timeout, deadline: {
            "master_address": address,
            "master_port": port,
            "world_size": world,
            "packed": True,
            "packed_buffer_size_bytes": buffer,
        },
        requires_cuda=True,
        partial_round=EngineState(
            "undefined", note="vLLM's NCCL backend processes layers that received part of their weights from what they have"
        ),
        aborts_round=False,
        patches_loaders=False,
        bounded=False,
        stages=False,
    ),
    "gloo": _Transport(
        retains_tensors=False,
        init_fields=lambda address, port, world, buffer, timeout, deadline: {
            "master_address": address,
            "master_port": port,
            "world_size": world,
            "buffer_bytes": buffer,
            "timeout_s": timeout,
            "deadline": deadline,
        },
        requires_cuda=False,
        partial_round=EngineState(
            "mixed",
            note="the server's gloo backend gives layers that received part of their weights their previous ones back "
            "and logs which weights hold which",
        ),
        aborts_round=True,
        patches_loaders=True,
        bounded=True,
        stages=True,
    ),
}
SUPPORTED_BACKENDS: tuple[str, ...] = tuple(_TRANSPORTS)

# The bound on asking a server its weight version after a failed round (an account of the failure, not a wait of
# the sync: a server that stopped answering was not asked).
_ASK_AFTER_FAILURE_S = 5.0


def transport_for(info: ServerInfo) -> _Transport:
    """The transport for the server's configured backend, decided once.

    Raises:
        ServerConfigError: the server has no weight-transfer backend, or one this writer does not drive, or one that
            needs CUDA on a trainer without it; says how to restart the server.
    """
    backend = info.weight_transfer_backend
    if backend is None:
        raise ServerConfigError(
            "The vLLM server was started without a weight-transfer backend, so weights cannot be sent to it. Restart "
            "it with --weight-transfer-config '{\"backend\": \"nccl\"}' (CUDA trainer and server) or "
            "'{\"backend\": \"gloo\"}' (any machine; needs fsdp-vllm-sync installed on the server), and "
            "VLLM_SERVER_DEV_MODE=1."
        )
    transport = _TRANSPORTS.get(backend)
    if transport is None:
        raise ServerConfigError(
            f"The vLLM server uses the weight-transfer backend {backend!r}; fsdp-vllm-sync supports "
            f"{list(SUPPORTED_BACKENDS)}. Restart the server with one of them."
        )
    if transport.requires_cuda and not torch.cuda.is_available():
        raise ServerConfigError(
            f"The vLLM server uses the {backend!r} weight-transfer backend, which needs CUDA on the trainer; this "
            "trainer has none. Restart the server with --weight-transfer-config '{\"backend\": \"gloo\"}'."
        )
    return transport


def check_server(address: ServerAddress, *, timeout_s: float) -> ServerInfo:
    """Wait for the server (up to the trainer's `vllm_server_timeout`) and check it can take weights.

    Raises:
        ServerUnavailableError: not up in time.
        ServerConfigError: no weight-transfer backend, an unsupported one, or no development routes.
    """
    client = ServerClient(address.base_url, timeout=timeout_s)
    client.wait_until_up(address.startup_timeout_s)
    info = client.server_info()
    transport = transport_for(info)
    if transport.patches_loaders:
        return info
    # NOTE: read on every rank, so that every rank's manifest refuses (or not) the same tensors.
    return dataclasses.replace(info, engine_fixes=client.engine_fixes())


class _UpstreamError(Exception):
    """Carries an exception raised by the sync's own stream through the transport's code, to tell it apart from
    the transport's failures."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _upstream_marked(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    it = iter(stream)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise _UpstreamError(e) from e
        yield item


@dataclass
class _Cut:
    """How a stream completed with placeholders was cut: its error and the announced tensors that were replaced."""

    error: Exception | None = None
    placeholders: list[str] = field(default_factory=list)


def _completed_with_placeholders(
    stream: Iterator[tuple[str, torch.Tensor]], meta: list[Any], cut: _Cut
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream; if it fails part-way, the rest of the announced tensors as placeholders (zeros, on the device of
    the last real tensor), so that a backend that cannot abort a round still completes it."""
    sent = 0
    device = torch.device("cpu")
    try:
        for name, tensor in stream:
            sent += 1
            device = tensor.device
            yield name, tensor
    except _UpstreamError as e:
        cut.error = e.error
        for m in meta[sent:]:
            cut.placeholders.append(m.name)
            yield m.name, torch.zeros(m.shape, dtype=m.dtype, device=device)


def local_address_towards(base_url: str) -> str:
    """This host's address on the interface that routes to the server (what the server's workers connect to)."""
    host = urlparse(base_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


class ServerWriter:
    """Push into a vLLM server through its weight-transfer API.

    Args:
        client: the server's control client on the main process; None on the other ranks (they do not send).
        info: the server's configuration (read on every rank before the trainer was built).
        group_port: the TCP port the sender hosts the transfer group on (TRL's `vllm_group_port`).
        checkpoint_dir: the checkpoint the server was started from, for the manifest (default: `info.model`).
        buffer_bytes: chunk size on the wire.
        timeout_s: the bound on each wait of the transfer.
        pause_for_write: pause the server's generation (`/pause?mode=keep`) while the engine's weights change, and
            resume it after, whatever happened (TRL's async trainer, whose rollouts keep generating during training).
            Where the transport stages (gloo), everything before the write (the gathers, the checks, the bytes on
            the wire) runs unpaused; with NCCL the pause covers the send.
        version_label: what each stamped weight version ends with (the async trainer's next `model_version`), so
            that the server's `/weight_info` names the policy version the rollouts are labelled with.

    Attributes:
        last_pause: the last push's pause, `(seconds from the pause request to the resume answer, seconds the write
            itself took)`; None when it did not pause.
    """

    def __init__(
        self,
        client: ServerClient | None,
        info: ServerInfo,
        *,
        group_port: int,
        checkpoint_dir: str | None = None,
        buffer_bytes: int,
        timeout_s: float,
        pause_for_write: bool = False,
        version_label: Callable[[], str] | None = None,
    ) -> None:
        self.client = client
        self.info = info
        self.transport = transport_for(info)
        self.backend = info.weight_transfer_backend
        self.kind = f"server:{self.backend}"
        self.pushes = client is not None
        self.retains_tensors = self.transport.retains_tensors
        self.engine_dtype: torch.dtype | None = info.dtype
        self.checkpoint_dir = checkpoint_dir or info.model
        self.group_port = group_port
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self._source: PlanSource | None = None
        self._engine: Any = None
        self._round_open = False
        self.engine_per_rank = False
        # `time.monotonic()` by which every wait of the current sync ends (`bound`).
        self._deadline: float | None = None
        self._versions = ServerVersions(client) if client is not None else None
        # The server's per-parameter digests as this plan read them (`engine_layout`), for the plan's other
        # questions (`sparse_refusal`, `patch_refusals`); dropped when the plan is announced (`prepare`).
        self._plan_checksums: dict[str, str] | None = None
        self.pause_for_write = pause_for_write
        # Decided once: the writes of a sync are staged and committed under a pause (`finish`).
        self.staged = pause_for_write and self.transport.stages
        self.version_label = version_label
        self.last_pause: tuple[float, float] | None = None
        # A sync began since the last staged round was sent: what a failed sync left staged is dropped first.
        self._new_sync = True
        # The name of the adapter version published last (requests ask for it by that name), and of the one sent
        # and not yet published (staged on the workers; verify reads it).
        self._adapter_name: str | None = None
        self._staged_name: str | None = None

    # --- AdapterWriter: adapter syncs (`fsdp_sync.sync.adapter`), over the transfer, into the server's LoRA manager ---

    def lora_limits(self) -> LoRALimits | None:
        """From the server's configuration (every rank has it); the target modules are checked by the server before
        it keeps anything."""
        rank = self.info.max_lora_rank
        return LoRALimits(rank, None, None) if rank is not None else None

    def kept_adapter_versions(self) -> int:
        """How many adapter versions the server keeps servable (`FSDP_VLLM_SYNC_ADAPTER_VERSIONS` there; the
        fewest any worker keeps), asked through a method this package's gloo backend gives its workers.

        Raises:
            ServerConfigError, ServerRequestError: the server cannot say (without the gloo backend, or an invalid
                setting there, named in the server's answer).
        """
        from fsdp_sync.compat.lora_patches import KEPT_VERSIONS_METHOD

        assert self.client is not None
        return min(int(k) for k in self.client.collective_rpc(KEPT_VERSIONS_METHOD))

    def adapter_transport_refusal(self) -> str | None:
        if self.backend != "gloo":
            return (
                f"adapter syncs to a server travel over this package's 'gloo' weight-transfer backend; the server "
                f"uses {self.backend!r}"
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
        data-parallel replica (asked over the transfer group: `ask_workers`); a tensor-parallel worker keeps the
        whole adapter (vLLM slices it only when it activates it).

        Raises:
            VerifyError: a worker keeps no such version.
        """
        name = self._staged_name
        assert self._engine is not None and name is not None, "no adapter was staged"
        try:
            asked = self._engine.ask_workers("adapter_digests", name)
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

    def manifest(self) -> EngineManifest:
        try:
            manifest = read_checkpoint_manifest(self.checkpoint_dir, engine_dtype=self.engine_dtype)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{e}. The server was started from {self.info.model!r}, which this trainer cannot read; set "
                "SyncConfig(checkpoint_dir=...) to a local copy of that checkpoint."
            ) from e
        if self.transport.patches_loaders:
            return manifest
        # NOTE: a server's model cannot be run dry from here (`compat.load_probe`); the loaders this package fixes on
        # the engine side are known by model class, and vLLM's own backends run them unfixed.
        gaps = unfixed_reload_gaps(self._architectures(), manifest.tensors)
        if gaps and "load_gpt_oss_through_weight_loaders" in self.info.engine_fixes:
            logger.info("weight sync: the server's weight-transfer engines load gpt-oss through weight loaders")
            gaps = {}
        return dataclasses.replace(manifest, refused=gaps) if gaps else manifest

    def prepare(self, planned: Sequence[PlannedTensor]) -> None:
        """The announced metadata, in stream order and in the dtype each tensor is sent in (per plan, and per
        selection of a delta sync)."""
        self._plan_checksums = None

        def wire_dtype(dtype: torch.dtype) -> torch.dtype:
            return self.engine_dtype if (self.engine_dtype is not None and dtype.is_floating_point) else dtype

        self._source = plan_source((t.name, wire_dtype(t.spec.dtype), t.spec.shape) for t in planned)
        if self._engine is not None:
            # NOTE: a transfer engine reads the source it was built with (`self.source`, in every vLLM version), and
            # a source's metadata never changes (vLLM 0.33+ requires it): a new selection (a delta sync) is a new
            # source, handed to the engine built at the first sync.
            self._engine.source = self._source

    def bound(self, deadline: float) -> None:
        """Every wait of this sync (each HTTP answer, the handshake, each chunk) ends by `deadline`
        (`time.monotonic()`), so that a server that stops answering fails the sync on every rank in time."""
        self._deadline = deadline
        self._new_sync = True
        self.last_pause = None
        if self.client is not None:
            self.client.deadline = deadline
        if self._engine is not None and self.transport.bounded:
            self._engine.bound(deadline)

    def replaced(self) -> str | None:
        """Why the server no longer holds what this writer last stamped (its weight version says so), or None. The
        transfer to the previous server process is dropped: the next push sets it up again.

        Raises:
            ServerUnavailableError: the server cannot be reached or did not answer; the transfer is dropped too (the
                server that answers next may be another process, and the sync after a failed one is complete, so
                it reads no version).
        """
        assert self._versions is not None
        try:
            why = self._versions.replaced()
        except ServerUnavailableError as e:
            e.engine = self._versions.after_failure(e, timeout_s=min(self.timeout_s, _ASK_AFTER_FAILURE_S))
            self._drop_transfer()
            raise
        if why is not None:
            self._drop_transfer()
        return why

    def stamp(self, version: str) -> str | None:
        """Give the server's weights `version` (after a complete push; nothing where its vLLM keeps none); returns
        the version stamped, with its label. A request that failed is read back (`ServerVersions`): it raises only
        when the server does not hold the version."""
        assert self._versions is not None
        return self._versions.stamp(f"{version}:{self.version_label()}" if self.version_label is not None else version)

    def close(self) -> None:
        """Close the transfer to the server (end of training); a later push sets it up again."""
        self._drop_transfer()

    def _drop_transfer(self) -> None:
        """Close the transfer now (its group port is free when this returns); the next push sets it up again."""
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # noqa: BLE001 - closing a failed transfer; the failure itself is what is raised
                logger.warning("weight sync: closing the failed %s transfer: %s", self.backend, e)

    def _connect(self) -> Any:
        """The handshake with the server (first sync, and the sync after a failed one)."""
        assert self.client is not None and self._source is not None and self.backend is not None
        from ..transfer.plugin import register

        register()
        engine_cls = trainer_transfer_engine(self.backend)
        world_size = 1 + self.client.world_size()
        fields = self.transport.init_fields(
            local_address_towards(self.client.base_url),
            self.group_port,
            world_size,
            self.buffer_bytes,
            self.timeout_s,
            self._deadline,
        )
        init_info = engine_cls.init_info_cls(**fields, rank=0)
        engine = engine_cls.trainer_init(init_info, client=self.client, source=self._source)
        if self.staged:
            cast("StagedTransfer", engine).staged = True
        logger.info(
            "weight sync: %s transfer to %s set up (%d server worker(s), port %d)",
            self.backend,
            self.client.base_url,
            world_size - 1,
            self.group_port,
        )
        return engine

    def _staging(self) -> StagedTransfer | None:
        """The transfer engine as a staging one (`StagedTransfer`), where this writer stages (decided once, from the
        transport's table) and the transfer is set up; else None."""
        return cast("StagedTransfer", self._engine) if self.staged and self._engine is not None else None

    def _begin_round(self) -> Any:
        """Close a round a failure left open on the server, and set the transfer up if it is not (first sync, or
        after a failed one); returns the trainer's transfer engine."""
        assert self.client is not None
        staging = self._staging()
        left_staged = self._new_sync and staging is not None and staging.pending
        if self._round_open or left_staged:
            # A failed round (or a failed sync's staged rounds, never committed) may have left the server's update
            # session open; close it (an error if it is not): the server drops what was staged.
            try:
                self.client.finish_weight_update()
            except ServerRequestError:
                pass
            if staging is not None:
                staging.abandon()
            self._round_open = False
        self._new_sync = False
        if self._engine is None:
            self._engine = self._connect()
        elif self.transport.bounded:
            self._engine.bound(self._deadline)
        return self._engine

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one sync's stream. A failure of the stream itself (the gather, the name mapping, ...) ends the round
        on the server at once (the gloo backend's abort marker); a failure of the server or of the transfer is raised
        as `ServerPushError` / `ServerTransportError`. Either way the transfer is set up again at the next sync, and
        the error says what the server holds."""
        assert self._source is not None, "prepare() must be called first"
        stage = "connect"
        cut = _Cut()
        engine: Any = None
        try:
            engine = self._begin_round()
            stage = "send"
            stream = _upstream_marked(weights)
            if not self.transport.aborts_round:
                stream = _completed_with_placeholders(stream, source_metadata(self._source), cut)
            self._source.feed(stream)
            self._round_open = True
            if self.pause_for_write and not self.staged:
                # NOTE: the prefix-cache reset inside the pause, as a staged commit does: a request resumed before it
                # could reuse KV blocks computed from the previous weights.
                with self._paused():
                    self._engine.send_weights()
                    self._round_open = False
                    stage = "reset"
                    self.client.reset_prefix_cache()
            else:
                self._engine.send_weights()
            self._round_open = False
        except ServerResumeError:
            raise
        except _UpstreamError as e:
            if not self.transport.aborts_round:
                self._drop_transfer()
            raise ServerPushError(
                f"The weight stream failed upstream of the server ({e.error}); the update was aborted.",
                engine=self._state(stage, engine, e.error),
            ) from e.error
        except (ServerRequestError, ServerConfigError) as e:
            raise ServerPushError(
                f"The vLLM server failed the weight update ({stage}): {e}.", engine=self._failed(stage, engine, e)
            ) from e
        except ServerUnavailableError as e:
            raise ServerTransportError(
                f"The vLLM server became unreachable ({stage}): {e}.", engine=self._failed(stage, engine, e)
            ) from e
        except Exception as e:
            raise ServerTransportError(
                f"The {self.backend} weight transfer to {self.info.model!r} failed ({stage}; "
                f"{type(e).__name__}: {e}).",
                engine=self._failed(stage, engine, e),
            ) from e
        if cut.error is not None:  # the round was completed with placeholders after the stream failed
            raise ServerPushError(
                f"The weight stream failed upstream of the server ({cut.error}); the round was completed with "
                f"placeholder tensors ({self.backend} cannot abort a round).",
                engine=EngineState("undefined", undefined=tuple(cut.placeholders), note="placeholders ended the round"),
            ) from cut.error

    def _failed(self, stage: str, engine: Any, error: Exception) -> EngineState:
        """After the server or the transfer failed: close the transfer now (the next push sets it up again) and say
        what the server holds."""
        state = self._state(stage, engine, error)
        self._drop_transfer()
        return state

    def _state(self, stage: str, engine: Any, error: Exception) -> EngineState:
        """What the server holds after a round that failed at `stage` with `error`: what its weight version says
        where it differs from the last stamp or where the server does not answer (a restarted or stopped server:
        the transport cannot know); else unchanged when no weight reached it (the handshake failed, or the
        transport says it sent no data: the gloo backend counts its chunks), else what the transport leaves after
        a partial round."""
        assert self._versions is not None
        seen = self._versions.after_failure(error, timeout_s=min(self.timeout_s, _ASK_AFTER_FAILURE_S))
        if seen is not None:
            return seen
        if stage == "connect":
            return EngineState("unchanged", note="no weight was sent; the next sync connects again")
        if stage == "reset":
            return EngineState(
                "current", note="every weight was written, but the prefix cache was not reset: cached blocks may have "
                "been computed from the previous weights"
            )
        if getattr(engine, "data_chunks", None) == 0:
            return EngineState("unchanged", note="the round ended before any weight was sent")
        return self.transport.partial_round

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
        if self.backend != "gloo":
            return (
                f"the server's {self.backend!r} weight-transfer backend takes whole tensors; sparse syncs to a server "
                "use this package's 'gloo' backend (vLLM's sparse_nccl backend is not driven yet)"
            )
        try:
            self._checksums()
        except ServerRouteMissing as e:
            return f"{e}, so it cannot say which of its weights can be patched in place (vLLM >= 0.32)"
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

    def write_patches(self, patches: Sequence[EnginePatch]) -> None:
        """Send one sparse update (gloo); errors as `write`'s."""
        assert self._source is not None, "prepare() must be called first"
        stage = "connect"
        engine: Any = None
        try:
            engine = self._begin_round()
            stage = "send"
            self._round_open = True
            self._engine.send_patches(patches)
            self._round_open = False
        except Exception as e:
            state = self._failed(stage, engine, e)
            if state.status not in ("unchanged", "unknown", "replaced"):
                state = EngineState("mixed", note="patches are written element by element and not rolled back")
            # The server answered with an error: its failure; anything else (no answer, the group): the transport's.
            server_said = isinstance(e, (ServerRequestError, ServerConfigError))
            raise (ServerPushError if server_said else ServerTransportError)(
                f"The sparse weight update to the vLLM server failed ({stage}; {type(e).__name__}: {e}).", engine=state
            ) from e

    def finish(self) -> None:
        """End the push: staged rounds are written now, with the server paused (`pause_for_write`); the prefix
        cache is reset (its blocks were computed from the previous weights), inside the pause where there is one
        (a paused write that does not stage reset it in `write`)."""
        assert self.client is not None
        if self.staged:
            self._commit()
            return
        if not self.pause_for_write:
            self.client.reset_prefix_cache()

    def _commit(self) -> None:
        """Pause, write what the staged rounds delivered, reset the prefix cache, resume (whatever happened).

        Raises:
            ServerPushError / ServerTransportError: the write failed; says what the server holds (a staged round
                that did not arrive whole leaves it unchanged; a write that failed part-way, old or new per layer).
        """
        staging = self._staging()
        assert self.client is not None and staging is not None
        stage = "commit"
        try:
            with self._paused():
                staging.commit()
                self.client.reset_prefix_cache()
        except (ServerRequestError, ServerConfigError) as e:
            raise ServerPushError(
                f"The vLLM server failed to write the staged weights: {e}.", engine=self._failed(stage, self._engine, e)
            ) from e
        except ServerUnavailableError as e:
            raise ServerTransportError(
                f"The vLLM server became unreachable ({stage}): {e}.", engine=self._failed(stage, self._engine, e)
            ) from e

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """The server's generation paused (requests kept, not aborted) for the block, and resumed after it even when
        it raised; the pause and the write are timed into `last_pause` whenever the server was paused.

        Raises:
            the block's own error (a resume that fails after it is logged); `ServerResumeError` when the block
            succeeded and the resume failed (the weights are written; the server stays paused).
        """
        assert self.client is not None
        asked = time.perf_counter()
        self.client.pause()
        paused = time.perf_counter()
        try:
            yield
        except BaseException:
            self._resume(asked, paused, after_failure=True)
            raise
        self._resume(asked, paused, after_failure=False)

    def _resume(self, asked: float, paused: float, *, after_failure: bool) -> None:
        """Resume the paused server and time the pause (`last_pause`); see `_paused`."""
        assert self.client is not None
        wrote = time.perf_counter()
        try:
            self.client.resume()
        except Exception as e:
            if after_failure:  # NOTE: the write's own error is the one raised; this one is logged beside it
                logger.error("weight sync: the vLLM server could not be resumed after the failed write: %s", e)
                return
            raise ServerResumeError(
                f"The weights were written, but the vLLM server could not be resumed ({type(e).__name__}: {e}); its "
                "generation stays paused until POST /resume succeeds.",
                engine=EngineState("current", note="the server's generation is paused"),
            ) from e
        finally:
            self.last_pause = (time.perf_counter() - asked, wrote - paused)
