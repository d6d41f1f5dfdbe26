"""Flat gatherers: one all-gather per FSDP unit of the *local shards cast to the engine dtype*, the next unit's
all-gather in flight while the current one is pushed.

Why: on the measured CPU setup the all-gather dominates a sync (fp32 gather of the 36M model: 180 ms; the same
bytes in bf16: 71 ms). Casting is elementwise, so casting each shard before the gather gives bit-identical full
tensors to casting after it, while every rank casts only its own shard and the wire carries engine-dtype bytes.
Both backends' own unshard paths gather in the parameter dtype (FSDP2 in its mixed-precision `param_dtype`), so
these gatherers run the collective themselves, on the unit's process group, reading FSDP's sharding metadata.

Peak memory: the unit being pushed plus the next one being gathered, when that one is no larger than the configured
`prefetch_bytes` (the "bucket"); larger units are gathered after the push of the previous one.

Failures on one rank (README "Failure behaviour"): the gatherers run the sync's status rounds (`Rounds`) around
every unit. A unit's all-gather starts only after every rank said its shard and output buffer are ready, and a
gathered unit is handed on only after every rank said its all-gather arrived; a failure anywhere on any rank
(here, or downstream: the mapping, the merge, the cast, the engine) stops every rank at the next round. So no rank
waits in an all-gather that another rank left, and no rank hands on a unit gathered with another rank's part
missing: there are no placeholder values. An all-gather call that raises after its round is joined again with a
zero shard of the same size (the other ranks are in it), and the unit is not handed on anywhere.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_sync.compat.manifest import CASTABLE_DTYPES, TensorSpec

from ..distributed import Rounds
from ..errors import SyncTimeoutError
from ..faults import fault_point
from ..memory import MemoryMeter
from .base import local_named_parameters, spec_of, sync_rounds
from .fsdp1 import _FSDP1Base
from .fsdp2 import _full_tensor, fsdp2_local_shards, fsdp2_trainable, fsdp2_units

__all__ = ["FSDP1FlatGatherer", "FSDP2FlatGatherer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_P = TypeVar("_P")  # what `prepare` returns
_L = TypeVar("_L")  # what `launch` returns


def _gather_dtype(dtype: torch.dtype, engine_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype on the wire: the engine's for castable floats (exact: the cast is elementwise), else its own."""
    if engine_dtype is not None and dtype in CASTABLE_DTYPES and engine_dtype in CASTABLE_DTYPES:
        return engine_dtype
    return dtype


# How long `_InFlight.wait` lets gloo's worker thread drop its references to a finished all-gather's output.
_RELEASE_WAIT_S = 1.0


@dataclass
class _InFlight:
    """One visit's all-gather: the output buffer and the handle to wait on.

    Attributes:
        settle: after the wait, hold on until the collective's own references to `out` are gone (gloo; see `wait`).
    """

    work: dist.Work | None
    out: torch.Tensor
    settle: bool = False

    def wait(self, timeout: datetime.timedelta | None) -> torch.Tensor:
        """The gathered buffer; `timeout` bounds the wait (gloo; None: the process group's own bound)."""
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                try:
                    self.work.wait(timeout)
                except RuntimeError as e:
                    raise SyncTimeoutError(
                        f"An all-gather of the weight sync did not complete within {timeout.total_seconds():g} s "
                        f"(SyncConfig.sync_timeout_s) on rank {dist.get_rank()}: {str(e).rstrip('.! ')}. Another rank "
                        "did not join it: "
                        "it is hung (e.g. still inside its engine push) or it died. The training process group "
                        "cannot be used any more; restart the job"
                    ) from e
            # NOTE: the Work holds the output until it is destroyed, and gloo's worker thread can still hold the Work
            # after `wait()` returns (measured on the first sync: the buffer was freed from that thread, after the
            # next unit's buffer was allocated: two units alive instead of one). Dropping the Work here and letting
            # the worker finish makes this rank's own release of the buffer the last one, so at most one unit is
            # alive at a time. Bounded: past the limit the buffer is released whenever gloo lets go of it.
            # `_use_count` (the C++ reference count) is the only way to see gloo's reference; it is private, hence
            # the guard.
            self.work = None
            if self.settle and hasattr(self.out, "_use_count"):
                deadline = time.monotonic() + _RELEASE_WAIT_S
                while self.out._use_count() > 1 and time.monotonic() < deadline:
                    time.sleep(0)
        return self.out


@dataclass
class _Gather:
    """One prepared all-gather: this rank's shard, the output buffer (None: the shard is the full tensor), group."""

    local: torch.Tensor
    out: torch.Tensor | None
    group: dist.ProcessGroup | None


def _gloo() -> bool:
    """Whether the collectives run on gloo, whose worker thread may outlive `wait()` holding the output."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def _always(rounds: Rounds, work: Callable[[], _T]) -> _T | None:
    """`work()` even after this rank failed (it completes collectives the other ranks are in); an error is recorded
    and None returned (a timed-out wait ends the rounds: `Rounds.fail`)."""
    try:
        return work()
    except Exception as e:
        rounds.fail("gather", e)
        return None


def _pipelined(
    visits: list[int],
    prepare: Callable[[int], _P],
    launch: Callable[[int, _P], _L],
    collect: Callable[[int, _L], list[tuple[str, torch.Tensor]]],
    sizes: list[int],
    limit: int,
    rounds: Rounds,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather and hand on each visit k, in the order of `visits`, with a status round before every launch and
    before every hand-off (see the module docstring).

    `prepare(k)` is this rank's own work before visit k's all-gather (its shard, its output buffer), `launch(k, p)`
    starts the collectives, `collect(k, l)` waits for them and returns the full tensors. When the next visit fits in
    `limit` bytes it is prepared while the current one is in flight, and one round then says both whether every
    rank's part of the current visit was real and whether every rank is ready for the next: that round travels while
    the current all-gather does (off the critical path), and the next all-gather runs during the current push.
    Larger visits are prepared after the push, behind a round of their own. Returns early, on every rank at the same
    round, once any rank has failed.
    """
    n = len(visits)
    if not n:
        return
    ready = rounds.attempt("gather", lambda: prepare(visits[0]))
    if not rounds.go_on():  # every rank's first shard and buffer are ready
        return
    launched = launch(visits[0], ready)  # type: ignore[arg-type]
    # NOTE: every reference to a unit's buffers is dropped as soon as it is no longer needed (the prepared shards,
    # the collected items): a buffer kept by this frame while the next unit is allocated would hold two at once.
    ready = None
    for i, k in enumerate(visits):
        following = visits[i + 1] if i + 1 < n else None
        early = following is not None and sizes[following] <= limit
        if early:
            ready = rounds.attempt("gather", lambda: prepare(following))  # type: ignore[arg-type]
        # This rank's part of visit k was real (its launch did not fall back to zeros), the next visit is ready,
        # nothing downstream failed: said while visit k's all-gather completes.
        started = rounds.start()
        items = _always(rounds, lambda: collect(k, launched))
        launched = None
        if not rounds.finish(started):
            return
        if early:
            launched = launch(following, ready)  # type: ignore[arg-type]
            ready = None
        for item in items or ():
            if rounds.failed:  # this rank's collect or its consumer failed: hand on nothing more (said next round)
                break
            yield item
            del item
        items = None
        if following is not None and not early:
            ready = rounds.attempt("gather", lambda: prepare(following))  # type: ignore[arg-type]
            if not rounds.go_on():
                return
            launched = launch(following, ready)  # type: ignore[arg-type]
            ready = None


def _launch_or_join(
    rounds: Rounds,
    k: int,
    units: int,
    gathers: list[tuple[torch.Tensor, torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> list[dist.Work | None]:
    """Start one all-gather per `(output, local shard)` of visit k. A launch that raises is recorded, and it and the
    rest are joined with zero shards of the same size: every other rank has agreed to start them and is in them."""
    works: list[dist.Work | None] = []
    zeros = False
    for index, (out, local) in enumerate(gathers):
        if not zeros:
            try:
                fault_point("gather.launch", unit=k, units=units, index=index)
                works.append(dist.all_gather_into_tensor(out, local, group=group, async_op=True))
                continue
            except Exception as e:
                rounds.fail("gather", e)
                zeros = True
        try:
            works.append(dist.all_gather_into_tensor(out, torch.zeros_like(local), group=group, async_op=True))
        except Exception as e:  # noqa: BLE001 - the first error is the one reported
            logger.error("weight sync: could not join an all-gather after a failed launch; the other ranks wait in "
                         "it until SyncConfig.sync_timeout_s: %s", e)  # fmt: skip
            works.append(None)
    return works


class _FlatBase:
    """What both flat gatherers share: the bound on waits, gloo's buffer settling, the status rounds."""

    def _init_flat(self, timeout_s: float | None) -> None:
        self._settle = _gloo()
        self._timeout_s = 600.0 if timeout_s is None else timeout_s
        # NOTE: a bounded `wait(timeout)` is a blocking wait; on NCCL it would also make the host wait for the
        # device, so NCCL's waits keep their own bound (the process group's timeout and watchdog).
        bounded = self._settle and timeout_s is not None
        self._timeout = datetime.timedelta(seconds=timeout_s) if bounded else None

    def _rounds(self, rounds: Rounds | None) -> Rounds:
        return sync_rounds(rounds, self._timeout_s)


class FSDP1FlatGatherer(_FSDP1Base, _FlatBase):
    """FSDP1: all-gather each unit's local flat-parameter shard, cast to the engine dtype, and unflatten it.

    NOTE: reads FSDP1's flat-parameter handle (`_handle.flat_param`, its process group and `_get_unflat_views`), the
    same metadata `summon_full_params` uses; FSDP1 is frozen (torch 2.0-2.13). Units nested in PEFT tuner layers
    need module-level full views for the merge, so PEFT models use the per-unit summon strategy instead.
    """

    strategy = "fsdp1-flat"
    tensors_outlive_step = True  # each unit's views keep their own freshly allocated buffer alive

    def __init__(
        self,
        model: nn.Module,
        *,
        engine_dtype: torch.dtype | None = None,
        compute_device: torch.device | None = None,
        prefetch_bytes: int = 2**30,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(model)
        self._init_flat(timeout_s)
        self.engine_dtype = engine_dtype
        self.compute_device = compute_device
        self.prefetch_bytes = prefetch_bytes
        self._units = [visit[0] for visit in self._visits]  # no companions without merge scopes
        self._sizes = [
            sum(spec.numel * _gather_dtype(spec.dtype, engine_dtype).itemsize for _, _, spec in params)
            for _, params in self._units
        ]

    def _prepare(self, k: int) -> _Gather | None:
        """This rank's shard of unit k, on the compute device, in the gather dtype, and the unit's output buffer
        (this rank's own work); None for a unit with nothing to gather."""
        fault_point("gather.prepare", unit=self._order[k], units=len(self._order))
        unit, params = self._units[k]
        handle = unit._handle
        if handle is None or not params:
            return None
        flat = handle.flat_param.detach()
        if self.compute_device is not None:
            flat = flat.to(self.compute_device)
        local = flat.to(_gather_dtype(flat.dtype, self.engine_dtype))
        world = dist.get_world_size(handle.process_group) if handle.uses_sharded_strategy else 1
        if world == 1:  # the shard is the full flat parameter: no collective, no copy
            return _Gather(local, None, handle.process_group)
        out = torch.empty(local.numel() * world, dtype=local.dtype, device=local.device)
        self._meter.hold_until_freed(out)
        return _Gather(local.contiguous(), out, handle.process_group)

    def _launch(self, k: int, prepared: _Gather | None) -> _InFlight | None:
        if prepared is None:
            return None
        if prepared.out is None:
            return _InFlight(None, prepared.local)
        (work,) = _launch_or_join(self._run, self._order[k], len(self._order), [(prepared.out, prepared.local)],
                                  prepared.group)  # fmt: skip
        return _InFlight(work, prepared.out, self._settle)

    def _collect(self, k: int, pending: _InFlight | None) -> list[tuple[str, torch.Tensor]]:
        if pending is None:
            return []
        full = pending.wait(self._timeout)
        fault_point("gather.unflatten", unit=self._order[k], units=len(self._order))
        unit, params = self._units[k]
        numel = unit._handle.flat_param._unpadded_unsharded_size.numel()
        views = unit._handle._get_unflat_views(full[:numel])
        select = self._select
        pairs = zip(params, views, strict=True)
        return [(name, view) for (name, _, _), view in pairs if select is None or name in select]

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._meter, self._select, self._run = meter, select, self._rounds(rounds)
        # NOTE: a flat parameter is gathered whole: a unit with any selected parameter is visited entire.
        visits = [k for k, (_, ps) in enumerate(self._units) if select is None or any(n in select for n, _, _ in ps)]
        self._order = {k: i for i, k in enumerate(visits)}  # position in this gather, for the fault points
        yield from _pipelined(
            visits, self._prepare, self._launch, self._collect, self._sizes, self.prefetch_bytes, self._run
        )
        if not self._run.stopped and not self._run.failed:
            yield from self._iter_ignored(select)


@dataclass(frozen=True)
class _Slot:
    name: str
    rows: int  # rows per rank (ceil of dim 0 over the world size)
    shape: tuple[int, ...]
    dtype: torch.dtype  # on the wire

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def local_numel(self) -> int:
        return self.rows * self.row_numel


@dataclass(frozen=True)
class _Visit:
    """One unit: the names it yields in order, the parameters gathered flat, the rest (full_tensor), and its mesh."""

    names: list[str]
    slots: list[_Slot]
    others: list[str]
    mesh: object


class FSDP2FlatGatherer(_FlatBase):
    """FSDP2: each parameter's local shard, cast to the engine dtype, all-gathered straight into its full layout
    (asynchronously, all of a unit's gathers in flight together, the next unit's started during the current push).

    FSDP2 shards dim 0 like `torch.chunk`: every rank holds at most `ceil(d0 / world)` rows, the short chunks last.
    Gathering `ceil(d0 / world)` rows from every rank (short shards padded) into a `world * ceil(d0 / world)`-row
    block therefore lays the full parameter out in order: its first `d0` rows, with no copy afterwards. Parameters
    that are not `Shard(0)` DTensors on a 1-D mesh (plain tensors, other layouts) are materialised one by one, as in
    the per-parameter strategy.
    """

    strategy = "fsdp2-flat"
    tensors_outlive_step = True  # every full tensor is a view of its unit's fresh buffer (or a fresh tensor)

    def __init__(
        self,
        model: nn.Module,
        *,
        engine_dtype: torch.dtype | None = None,
        compute_device: torch.device | None = None,
        prefetch_bytes: int = 2**30,
        timeout_s: float | None = None,
    ) -> None:
        self._init_flat(timeout_s)
        self._select: frozenset[str] | None = None
        self.model = model
        self.engine_dtype = engine_dtype
        self.compute_device = compute_device
        self.prefetch_bytes = prefetch_bytes
        planned = dict(model.named_parameters())
        # NOTE: by name once, not one `get_parameter` (a module walk) per parameter and sync; FSDP2 keeps the
        # parameter objects (its DTensors) for the module's lifetime.
        self._params = planned
        units = fsdp2_units(model)
        if not units:
            raise ValueError(f"{type(model).__name__} contains no FSDP2 (fully_shard) unit")
        visits = ([] if isinstance(model, FSDPModule) else [("", model)]) + units
        emitted: set[str] = set()
        self._visits: list[_Visit] = []
        for path, unit in visits:
            names = [n for n, _ in local_named_parameters(unit, path, FSDPModule) if n in planned and n not in emitted]
            emitted.update(names)
            slots: list[_Slot] = []
            others: list[str] = []
            mesh = None
            for name in names:
                param = planned[name]
                if not _flat_gatherable(param):
                    others.append(name)
                    continue
                mesh = param.device_mesh
                rows = math.ceil(param.shape[0] / mesh.size())
                slots.append(_Slot(name, rows, tuple(param.shape), _gather_dtype(param.dtype, engine_dtype)))
            # Grouped by wire dtype, as the collectives are launched.
            slots.sort(key=lambda slot: str(slot.dtype))
            self._visits.append(_Visit(names, slots, others, mesh))
        self._specs = {n: spec_of(planned[n]) for visit in self._visits for n in visit.names}
        self._sizes = [
            sum(visit.mesh.size() * s.local_numel * s.dtype.itemsize for s in visit.slots) if visit.slots else 0
            for visit in self._visits
        ]

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return fsdp2_local_shards(self.model, self._specs if names is None else names)

    @torch.no_grad()
    def _cast(self, local: torch.Tensor, slot: _Slot) -> torch.Tensor:
        """A local shard on the compute device, in the wire dtype."""
        if self.compute_device is not None:
            local = local.to(self.compute_device)
        return local.to(slot.dtype)

    def _local(self, slot: _Slot) -> torch.Tensor:
        """This rank's shard of one parameter as a 1-D tensor of `slot.rows` rows in its wire dtype (padded if
        short)."""
        # Detached: a tensor that required grad would make the collective's in-place writes illegal.
        local = self._params[slot.name].to_local().detach()
        if local.shape[0] == slot.rows:
            return self._cast(local, slot).contiguous().view(-1)
        if self.compute_device is not None:
            local = local.to(self.compute_device)
        padded = torch.empty(slot.local_numel, dtype=slot.dtype, device=local.device)
        padded[: local.numel()].copy_(local.reshape(-1))  # the padding rows are never read back
        return padded

    def _slots(self, k: int) -> list[_Slot]:
        """Unit k's flat-gathered parameters this sync gathers (all, or those selected)."""
        select = self._select
        return [s for s in self._visits[k].slots if select is None or s.name in select]

    def _prepare(self, k: int) -> list[tuple[_Slot, torch.Tensor, torch.Tensor | None]]:
        """This rank's shard of each of unit k's flat-gathered parameters, in slot order, with its output buffer
        (None where the local shard is the full parameter): this rank's own work."""
        fault_point("gather.prepare", unit=self._order[k], units=len(self._order))
        visit = self._visits[k]
        world = visit.mesh.size() if visit.mesh is not None else 1
        if world == 1:  # the local shards are the full parameters, in their own shape: nothing to gather
            params = self._params
            return [(slot, self._cast(params[slot.name].to_local().detach(), slot), None) for slot in self._slots(k)]
        prepared: list[tuple[_Slot, torch.Tensor, torch.Tensor | None]] = []
        for slot in self._slots(k):
            local = self._local(slot)
            # NOTE: one output per parameter, not one per unit: a consumer still holding a unit's last tensor while
            # it asks for the next unit then pins one parameter, not the whole unit.
            out = torch.empty(world * local.numel(), dtype=slot.dtype, device=local.device)
            self._meter.hold_until_freed(out)
            prepared.append((slot, local, out))
        return prepared

    def _launch(
        self, k: int, prepared: list[tuple[_Slot, torch.Tensor, torch.Tensor | None]]
    ) -> list[tuple[_Slot, _InFlight]]:
        gathers = [(out, local) for _, local, out in prepared if out is not None]
        if not gathers:  # nothing to gather: the local shards are the full parameters
            return [(slot, _InFlight(None, local)) for slot, local, _ in prepared]
        works = _launch_or_join(self._run, self._order[k], len(self._order), gathers, self._visits[k].mesh.get_group())
        pairs = zip(prepared, works, strict=True)
        return [(slot, _InFlight(work, out, self._settle)) for (slot, _, out), work in pairs]

    def _collect(self, k: int, pending: list[tuple[_Slot, _InFlight]]) -> list[tuple[str, torch.Tensor]]:
        """Wait for unit k's all-gathers and return its full tensors in yield order; the parameters that are not
        flat-gathered are materialised here, before the round (each `full_tensor()` is a collective of its own)."""
        visit = self._visits[k]
        outs = {slot.name: (slot, in_flight.wait(self._timeout)) for slot, in_flight in pending}
        pending.clear()
        fault_point("gather.unflatten", unit=self._order[k], units=len(self._order))
        select = self._select
        items: list[tuple[str, torch.Tensor]] = []
        for name in visit.names:
            if select is not None and name not in select:
                continue
            if name in outs:
                slot, out = outs.pop(name)
                full = out if out.shape == slot.shape else out[: slot.shape[0] * slot.row_numel].view(slot.shape)
                items.append((name, full))
            else:
                items.append((name, _full_tensor(self.model.get_parameter(name), self.compute_device, self._meter)))
        return items

    def trainable(self) -> frozenset[str]:
        return fsdp2_trainable(self.model, self._specs)

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._meter, self._select, self._run = meter, select, self._rounds(rounds)
        # Units that own no parameter this sync sends (accelerate's FSDP2 wrap has some) are not visited.
        visits = [k for k, v in enumerate(self._visits) if any(select is None or n in select for n in v.names)]
        self._order = {k: i for i, k in enumerate(visits)}  # position in this gather, for the fault points
        sizes = [
            sum(v.mesh.size() * s.local_numel * s.dtype.itemsize for s in self._slots(k)) if v.slots else 0
            for k, v in enumerate(self._visits)
        ]
        yield from _pipelined(visits, self._prepare, self._launch, self._collect, sizes, self.prefetch_bytes, self._run)


def _flat_gatherable(param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and param.device_mesh.ndim == 1
        and tuple(param.placements) == (Shard(0),)
        and param.ndim >= 1
    )
