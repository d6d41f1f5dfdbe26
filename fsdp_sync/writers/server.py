"""Server writer: weights go to a separate vLLM server through vLLM's weight-transfer API.

Split by concern: the backends and what each can carry (`server_transports.py`), what the server says of its weights
(`server_layout.py`: digests, cuts, patchable weights), adapter syncs (`server_adapters.py`), routed pushes from every
trainer rank (`server_routes.py`); this module holds the session with the server, the push, its pause and staging,
and the weight versions.

The transport is the one the server was started with (`--weight-transfer-config '{"backend": ...}'`), chosen once:
`nccl` (vLLM's own NCCL trainer engine, what TRL uses; CUDA trainers) or `gloo` (this package's CPU backend,
`fsdp_sync.transfer.gloo`). Both are reached through vLLM's registry of trainer engines and driven through the same
four-call protocol (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`).

The main process talks to the server (every HTTP call, the handshake it hosts). On a backend that routes (gloo:
`server_routes.py`) into a server of several workers, every trainer rank sends its share of each dense update and
each worker receives only its cut; elsewhere the main process sends every tensor. The tensors are announced from the sync plan (names, engine dtypes,
shapes in stream order), so there is no metadata gather pass as in TRL.

Why no rank's sends wait on a collective another rank is not in: a rank only sends while it iterates the sync's
stream, and every tensor of that stream comes out of a gather that all ranks run in the same order. The transfer
groups are groups of their own (the sender and the server's workers; for routed updates every trainer rank and every
worker, point to point only); the trainer's ranks run no collective inside them. After a failed send a rank drains
the rest of the stream (so the gathers complete on every rank) before the ranks agree on the outcome
(`fsdp_sync.sync.push.Push.run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from fsdp_sync.compat.checkpoint import read_checkpoint_manifest
from fsdp_sync.compat.manifest import EngineManifest, PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch
from fsdp_sync.compat.server_api import ServerInfo
from fsdp_sync.compat.vllm_patches import unfixed_reload_gaps
from fsdp_sync.compat.weight_transfer import PlanSource, plan_source, source_metadata, trainer_transfer_engine
from ..distributed import rank
from ..distributed import world_size as trainer_ranks
from ..errors import EngineState, StreamInterrupted, SyncError
from ..versions import ServerVersions
from ..server_client import ServerClient, ServerConfigError, ServerRequestError, ServerUnavailableError
from .server_adapters import ServerAdapters
from .server_layout import ServerLayout
from .server_routes import ServerRoutes
from .server_transports import (
    SUPPORTED_BACKENDS,
    Cut,
    UpstreamError,
    check_server,
    completed_with_placeholders,
    local_address_towards,
    transport_for,
    upstream_marked,
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
    "local_address_towards",
    "transport_for",
]

logger = logging.getLogger(__name__)

# The bound on asking a server its weight version after a failed round (an account of the failure, not a wait of
# the sync: a server that stopped answering was not asked).
_ASK_AFTER_FAILURE_S = 5.0


class ServerPushError(SyncError):
    """The server refused or failed a weight update (its HTTP answer is in the message)."""


class ServerTransportError(SyncError):
    """The transfer group itself failed (connection lost, timeout): a network error, not an engine error."""


class ServerResumeError(ServerPushError):
    """The weights were written under a pause, but the server did not resume its generation (`POST /resume`)."""


class ServerWriter(ServerLayout, ServerAdapters, ServerRoutes):
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
        self._init_routes()

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
        if hasattr(self._engine, "sent_bytes"):
            # What this rank sends is counted per sync (`sent_bytes`, `worker_bytes`), over all of its rounds.
            self._engine.sent_bytes, self._engine.worker_bytes = 0, []

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
        self._route_host = None
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
        if self._ticket is not None:
            # a routed push: every trainer rank joins the route group, at the store `route_ticket` listens on
            fields.update(route_senders=trainer_ranks(), host=self._route_host)
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
        try:
            self._write(weights)
        finally:
            self._ticket = self._route_host = None  # a ticket is for one push (the engine holds the store now)

    def _write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stage = "connect"
        cut = Cut()
        engine: Any = None
        try:
            engine = self._begin_round()
            stage = "send"
            stream = upstream_marked(weights)
            if not self.transport.aborts_round:
                stream = completed_with_placeholders(stream, source_metadata(self._source), cut)
            self._source.feed(stream)
            self._round_open = True
            route = self.route
            if self.pause_for_write and not self.staged:
                # NOTE: the prefix-cache reset inside the pause, as a staged commit does: a request resumed before it
                # could reuse KV blocks computed from the previous weights.
                with self._paused():
                    self._send(route)
                    self._round_open = False
                    stage = "reset"
                    self.client.reset_prefix_cache()
            else:
                self._send(route)
            self._round_open = False
        except ServerResumeError:
            raise
        except UpstreamError as e:
            if not self.transport.aborts_round or self._ticket is not None:
                # NOTE: a routed round is set up again on every rank (each rank drops its own after a failure).
                self._drop_transfer()
            raise ServerPushError(
                f"The weight stream failed upstream of the server ({e.error}); the update was aborted.",
                engine=self._state(stage, engine, e.error),
            ) from e.error
        except (ServerRequestError, ServerConfigError) as e:
            raise ServerPushError(
                f"The vLLM server failed the weight update ({stage}): {e}.", engine=self._failed(stage, engine, e)
            ) from self._routed_cause(e)
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

    def _routed_cause(self, error: Exception) -> Exception:
        """The cause of this rank's failed push: the server's `error`; or, where the server failed a routed round
        because another trainer rank aborted it (that rank's own failure, which it records), the interruption: this
        rank's push ended by the other's failure, not its own, as when its stream stops at the gather's next round
        (issue 50: under load the server's answer reached this rank first, and both ranks were named)."""
        from fsdp_sync.transfer.gloo_wire import aborted_by

        other = aborted_by(str(error)) if self._ticket is not None else None
        if other is None or other == rank():
            return error
        interrupted = StreamInterrupted(f"trainer rank {other} aborted the routed update")
        interrupted.__cause__ = error
        return interrupted

    def _send(self, route: Any) -> None:
        """The round itself: routed where this update has a route (`ServerRoutes`), else broadcast."""
        if route is None:
            self._engine.send_weights()
        else:
            self._engine.send_weights(route)

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

    def write_patches(self, patches: Sequence[EnginePatch]) -> None:
        """Send one sparse update (gloo); errors as `write`'s."""
        assert self._source is not None, "prepare() must be called first"
        stage = "connect"
        engine: Any = None
        try:
            engine = self._begin_round()
            stage = "send"
            self._round_open = True
            self._engine.send_patches(patches, self.patch_route(patches))
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
