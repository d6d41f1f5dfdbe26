"""Routed server pushes (`fsdp_sync.transfer.routes`): every trainer rank sends its share of each dense update, and
every worker receives only its cut. Part of `ServerWriter` (a mixin of it): the sender plans each update's route
(`route_ticket`), every rank takes it (`take_ticket`, over the control group), and the other ranks send their share
(`share`) while the sender sends its own through `write`.

Why a ticket handed to every rank: the route depends on the server (its workers and their cuts), which only the
sender asks; the other ranks must follow the same plan, and must join a new handshake exactly when the sender makes
one (the first sync, and the one after a failed push: every rank drops its transfer then).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fsdp_sync.compat.engine_api import engine_naming_for_architectures, worker_place
from fsdp_sync.compat.weight_transfer import PlanSource, source_metadata, trainer_transfer_engine

from ..distributed import rank, world_size
from ..server_client import ServerConfigError, ServerRequestError

if TYPE_CHECKING:
    from fsdp_sync.compat.patch_api import EnginePatch
    from fsdp_sync.transfer.routes import RoutedPatches

    from ..server_client import ServerClient
    from .server_transports import Transport

__all__ = ["RouteTicket", "ServerRoutes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteTicket:
    """What every trainer rank needs of one routed update, decided by the sender.

    Attributes:
        connect: the sender sets the transfer up in this push (every rank joins the new route group).
        address, port: the sender's rendezvous.
        workers: the server's workers (every replica's).
        route: the update's `RoutePlan`, as JSON.
    """

    connect: bool
    address: str
    port: int
    workers: int
    route: dict[str, Any]


class ServerRoutes:
    """The routing half of `ServerWriter` (which holds the state named below)."""

    client: ServerClient | None
    transport: Transport
    backend: str | None
    buffer_bytes: int
    timeout_s: float
    group_port: int
    _source: PlanSource | None
    _engine: Any
    _deadline: float | None

    # NOTE: `_architectures` (ServerLayout's) and `_drop_transfer` (ServerWriter's) come from the writer.

    def _init_routes(self) -> None:
        # Decided once: whether pushes are routed (the transport can), and so whether every rank sends.
        self.shares = self.transport.routes
        self._ticket: RouteTicket | None = None
        # The current push is routed (its ticket said so), on every rank.
        self._routed = False
        self._tags = 0
        # (workers, the places' rules in place order) as the server said them (no places: not routed); asked again
        # for each transfer.
        self._route_layout: tuple[int, list[dict[str, Any]]] | None = None
        # The cuts of the announced source (`prepare`), per source; of each patched tensor, by name (each place's).
        self._route_cuts: tuple[int, list[list[Any]]] | None = None
        self._patch_cuts: dict[str, list[Any]] = {}
        # The sender's rendezvous store, listening from the ticket of a push that sets the transfer up until its
        # handshake takes it: the other ranks connect to a live store, which closes at once if the sender fails.
        self._route_host: Any = None

    def route_ticket(self) -> RouteTicket | None:
        """The sender's plan of the next dense update (None: the transport does not route).

        Raises:
            whatever the server raised when asked its workers (the push then fails on this rank, before any rank
            sends).
        """
        from fsdp_sync.transfer.routes import plan_route

        from .server_transports import local_address_towards

        if not self.shares or self.client is None:
            return None
        assert self._source is not None, "prepare() must be called first"
        if self._engine is None or self._route_layout is None:  # asked once per transfer
            self._route_layout = self._ask_route_layout()
            self._route_cuts, self._patch_cuts = None, {}
        if not self._route_layout[1]:
            return None  # one worker: broadcast (see `_ask_route_layout`)
        # NOTE: a transfer set up by a round that is not routed (an adapter's, patches') has no route group.
        connect = self._engine is None or getattr(self._engine, "route_group", None) is None
        address = local_address_towards(self.client.base_url)
        if connect:
            from fsdp_sync.transfer.gloo_wire import listen

            self._drop_transfer()  # a transfer set up without a route group holds the port
            self._route_host = listen(address, self.group_port, 1 + self._route_layout[0], self.timeout_s)
        workers, _ = self._route_layout
        meta = source_metadata(self._source)
        cuts = self._cuts(meta)
        self._tags = (self._tags + 1) % (1 << 30)
        route = plan_route(
            [m.shape for m in meta],
            [m.dtype for m in meta],
            cuts,
            senders=world_size(),
            workers=workers,
            buffer_bytes=self.buffer_bytes,
            tag=self._tags,
        )
        return RouteTicket(connect, address, self.group_port, workers, route.as_json())

    def _ask_route_layout(self) -> tuple[int, list[dict[str, Any]]]:
        """The server's worker count and each place's rules (`compat.tp_shards`), in place order; where the server
        cannot say its cuts, or its places are not in tensor-parallel order, every worker gets whole tensors. No
        places at all for a server of one worker: its pushes are broadcast from rank 0.

        NOTE: one worker is not routed (yet): in the CI rehearsal of the first version, which routed it from every
        trainer rank, two single-worker server tests failed that had passed before and passed again in local reruns
        (a job whose check after a fault sequence saw exact weights and other logprobs; a killed server now failing
        the sharing rank too). Multi-worker servers, what routing is for, passed every test.
        """
        assert self.client is not None
        workers = self.client.world_size()
        if workers == 1:
            return workers, []
        try:
            rules = self.client.shard_rules()
        except (ServerConfigError, ServerRequestError) as e:
            logger.warning("weight sync: the server cannot say how its workers cut weights (%s): each gets them whole", e)
            return workers, [{}]
        places = list(rules)
        if workers % len(places) or any(p and p.rsplit(":", 1)[-1] != f"tp{i}" for i, p in enumerate(places)):
            logger.warning(
                "weight sync: the server's workers (%d; places %s) are not whole replicas of tensor-parallel workers "
                "in order: each gets its weights whole",
                workers,
                places,
            )
            return workers, [{}]
        return workers, [rules[p] for p in places]

    def _cuts(self, meta: list[Any]) -> list[list[Any]]:
        """Each place's cut of each announced tensor (kept per announced source)."""
        from fsdp_sync.transfer.routes import plan_cuts

        assert self._route_layout is not None and self._source is not None
        if self._route_cuts is not None and self._route_cuts[0] == id(self._source):
            return self._route_cuts[1]
        naming = engine_naming_for_architectures(self._architectures())
        cuts, whole = plan_cuts([m.name for m in meta], [m.shape for m in meta], naming.parameter, self._route_layout[1])
        if whole:
            logger.info(
                "weight sync: %d tensor(s) go whole to workers that shard them (their cut is not one this package "
                "reads): %s",
                len(whole),
                ", ".join(whole[:5]) + (" ..." if len(whole) > 5 else ""),
            )
        self._route_cuts = (id(self._source), cuts)
        return cuts

    def patch_route(self, patches: Sequence[EnginePatch]) -> RoutedPatches | None:
        """The sender's routed sparse update (`routes.route_patches`): each worker only the changes inside its cut.
        None: broadcast whole (a server of one worker, a transfer without a route group: one set up by a round that
        does not route, a transport that routes nothing, or workers that each hold every patched tensor whole)."""
        from fsdp_sync.transfer.routes import plan_cuts, route_patches

        layout = self._route_layout
        if not self.shares or layout is None or not layout[1] or getattr(self._engine, "route_group", None) is None:
            return None
        known = self._patch_cuts
        missing = [p for p in patches if p.name not in known]
        if missing:  # each tensor's cuts once per layout: the patched tensors differ from sync to sync
            naming = engine_naming_for_architectures(self._architectures())
            found, _ = plan_cuts([p.name for p in missing], [p.shape for p in missing], naming.parameter, layout[1])
            known.update((p.name, [place[i] for place in found]) for i, p in enumerate(missing))
        cuts = [[known[p.name][place] for p in patches] for place in range(len(layout[1]))]
        if all(cut is None for place in cuts for cut in place):
            # NOTE: every worker receives every change (data-parallel replicas of one worker each): a broadcast
            # carries the same bytes, and the workers receive them at once rather than one after the other.
            return None
        self._tags = (self._tags + 1) % (1 << 30)
        return route_patches(
            patches, cuts, senders=world_size(), workers=layout[0], buffer_bytes=self.buffer_bytes, tag=self._tags
        )

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank put on the wire in its last sync (its share of a routed one; 0 without a transfer;
        zeroed by `bound`, at each sync)."""
        return int(getattr(self._engine, "sent_bytes", 0))

    @property
    def worker_bytes(self) -> tuple[int, ...]:
        """Of `sent_bytes`, what went to each server worker (a broadcast's: every byte to every worker)."""
        return tuple(getattr(self._engine, "worker_bytes", ()))

    def take_ticket(self, ticket: RouteTicket | None) -> None:
        """The update's ticket, on every rank (None: not routed: the sender broadcasts, the other ranks drain)."""
        self._ticket = ticket
        self._routed = ticket is not None

    @property
    def route(self) -> Any:
        """The current update's `RoutePlan` (None: not routed)."""
        from fsdp_sync.transfer.routes import RoutePlan

        return RoutePlan.from_json(self._ticket.route) if self._ticket is not None else None

    def share(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A rank other than the sender: send this rank's share of the update (its ticket's route), joining the
        sender's new route group first where the ticket says it sets one up; without a route, only drain.

        Raises:
            whatever the route group or a send raised, or the stream's own error.
        """
        from fsdp_sync.transfer.routes import RoutePlan

        ticket, self._ticket = self._ticket, None  # a ticket is for one push
        if ticket is None:
            for _ in weights:
                pass
            return
        assert self._source is not None, "prepare() must be called first"
        if ticket.connect or self._engine is None:
            self._drop_transfer()
            self._engine = self._join(ticket)
        self._engine.source = self._source
        self._source.feed(weights)
        # NOTE: a failed share keeps its group until the ranks agree (`route_failed`): its aborts are still on the wire.
        self._engine.send_weights(RoutePlan.from_json(ticket.route))

    def route_failed(self) -> None:
        """Every rank, after a push the ranks agreed failed: a routed one's transfer is dropped (its sends may be
        part-way), so that every rank sets it up again at the next push; a broadcast keeps its own (its round was
        aborted on the workers)."""
        if self._routed:
            self._drop_transfer()

    def _join(self, ticket: RouteTicket) -> Any:
        """This rank's end of the sender's new transfer: a member of its route group."""
        from ..transfer.plugin import register

        assert self.backend is not None and self._source is not None
        register()
        engine_cls = trainer_transfer_engine(self.backend)
        fields = self.transport.init_fields(
            ticket.address, ticket.port, 1 + ticket.workers, self.buffer_bytes, self.timeout_s, self._deadline
        )
        init_info = engine_cls.init_info_cls(**fields, route_senders=world_size(), rank=rank())
        return engine_cls.trainer_init(init_info, client=None, source=self._source)
