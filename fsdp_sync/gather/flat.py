"""Flat gatherers: one all-gather per FSDP unit of the *local shards cast to the engine dtype*, the next unit's
all-gather in flight while the current one is pushed.

Why: on the measured CPU setup the all-gather dominates a sync (fp32 gather of the 36M model: 180 ms; the same
bytes in bf16: 71 ms). Casting is elementwise, so casting each shard before the gather gives bit-identical full
tensors to casting after it, while every rank casts only its own shard and the wire carries engine-dtype bytes.
Both backends' own unshard paths gather in the parameter dtype (FSDP2 in its mixed-precision `param_dtype`), so
these gatherers run the collective themselves, on the unit's process group, reading FSDP's sharding metadata.

Peak memory: the unit being pushed plus the next one being gathered, when that one is no larger than the configured
`prefetch_bytes` (the "bucket"); larger units are gathered after the push of the previous one.

Failures on one rank: these gatherers run every collective themselves, so when this rank's own work fails (reading
or casting its shard, unflattening a gathered unit), it keeps running the remaining all-gathers of the sync, yields
nothing more, and raises `GatherFailed` at the end. A shard it cannot prepare is replaced by a placeholder of the
same size (the other ranks then receive undefined values for that unit, and `GatherFailed.placeholders` names
them); later shards are still prepared, so the other ranks get real data wherever this rank can give it. No other
rank waits for a collective this rank does not enter, and the training process group stays usable. On gloo each wait is
bounded by the sync's timeout (`SyncConfig.sync_timeout_s`); NCCL's waits are bounded by NCCL itself.
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_sync.compat.manifest import CASTABLE_DTYPES, TensorSpec

from ..errors import SyncTimeoutError
from ..memory import MemoryMeter
from .base import FailureLatch, local_named_parameters, spec_of
from .fsdp1 import _FSDP1Base
from .fsdp2 import _full_tensor, fsdp2_local_shards, fsdp2_trainable, fsdp2_units

__all__ = ["FSDP1FlatGatherer", "FSDP2FlatGatherer"]


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


def _gloo() -> bool:
    """Whether the collectives run on gloo, whose worker thread may outlive `wait()` holding the output."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup | None, world: int, settle: bool) -> _InFlight:
    """Start an async all-gather of a 1-D tensor (equal size on every rank) into a new buffer.

    With one rank the shard is the full tensor: it is returned as is (no collective, no copy).
    """
    if world == 1:
        return _InFlight(None, local)
    out = torch.empty(local.numel() * world, dtype=local.dtype, device=local.device)
    work = dist.all_gather_into_tensor(out, local.contiguous(), group=group, async_op=True)
    return _InFlight(work, out, settle)


def _pipelined(
    visits: list[int],
    start: Callable[[int], object],
    finish: Callable[[int, object], Iterator],
    sizes: list[int],
    limit: int,
    latch: FailureLatch,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each visit k's tensors from `finish(k, start(k))`, in the order of `visits`, starting the next visit's
    gather before that when it fits in `limit` bytes (so at most one unit plus `limit` bytes are gathered at once).
    Once `latch` holds a failure, `start` and `finish` only run the collectives; at the end the failure is raised
    (`GatherFailed`)."""
    n = len(visits)
    pending = start(visits[0]) if n else None
    for i, k in enumerate(visits):
        early = i + 1 < n and sizes[visits[i + 1]] <= limit
        following = start(visits[i + 1]) if early else None
        yield from finish(k, pending)
        pending = None  # release visit k's buffer before a late start allocates the next one
        if i + 1 < n:
            pending = following if early else start(visits[i + 1])
    latch.raise_if_failed(completed=True)


class _FlatBase:
    """What both flat gatherers share: the failure latch, the bound on waits, gloo's buffer settling."""

    def _init_flat(self, timeout_s: float | None) -> None:
        self._settle = _gloo()
        # NOTE: a bounded `wait(timeout)` is a blocking wait; on NCCL it would also make the host wait for the
        # device, so NCCL's waits keep their own bound (the process group's timeout and watchdog).
        bounded = self._settle and timeout_s is not None
        self._timeout = datetime.timedelta(seconds=timeout_s) if bounded else None
        self._latch = FailureLatch()


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

    def _prepare(self, k: int) -> torch.Tensor:
        """This rank's shard of unit k, on the compute device, in the gather dtype (this rank's own work)."""
        flat = self._units[k][0]._handle.flat_param.detach()
        if self.compute_device is not None:
            flat = flat.to(self.compute_device)
        return flat.to(_gather_dtype(flat.dtype, self.engine_dtype))

    def _start(self, k: int) -> _InFlight:
        unit, params = self._units[k]
        handle = unit._handle
        if handle is None or not params:
            return _InFlight(None, torch.empty(0))
        world = dist.get_world_size(handle.process_group) if handle.uses_sharded_strategy else 1
        local = self._latch.attempt(lambda: self._prepare(k), [name for name, _, _ in params])
        if local is None:  # this rank failed: join the all-gather with a placeholder of the same size
            if world == 1:
                return _InFlight(None, torch.empty(0))
            flat = handle.flat_param
            dtype = _gather_dtype(flat.dtype, self.engine_dtype)
            local = torch.empty(flat.numel(), dtype=dtype, device=self.compute_device or flat.device)
        return _all_gather(local, handle.process_group, world, self._settle)

    def _views(self, k: int, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        unit, params = self._units[k]
        handle = unit._handle
        numel = handle.flat_param._unpadded_unsharded_size.numel()
        views = handle._get_unflat_views(full[:numel])
        return [(name, view) for (name, _, _), view in zip(params, views, strict=True)]

    def _finish(self, k: int, pending: _InFlight, select: frozenset[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._units[k][1]:
            return
        full = pending.wait(self._timeout)
        items = self._latch.run(functools.partial(self._views, k, full))
        del full
        yield from ((name, view) for name, view in items or () if select is None or name in select)

    def iter_full(self, meter: MemoryMeter, select: frozenset[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        self._latch.reset()

        def start(k: int) -> _InFlight:
            pending = self._start(k)
            if pending.work is not None:  # a new buffer (with one rank the shard itself is used)
                meter.hold_until_freed(pending.out)
            return pending

        def finish(k: int, pending: _InFlight) -> Iterator[tuple[str, torch.Tensor]]:
            return self._finish(k, pending, select)

        # NOTE: a flat parameter is gathered whole: a unit with any selected parameter is visited entire.
        visits = [k for k, (_, params) in enumerate(self._units) if select is None or any(n in select for n, _, _ in params)]
        yield from _pipelined(visits, start, finish, self._sizes, self.prefetch_bytes, self._latch)
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
    def _local(self, slot: _Slot) -> torch.Tensor:
        """This rank's shard of one parameter as a 1-D tensor of `slot.rows` rows in its wire dtype (padded if
        short)."""
        # Detached: a tensor that required grad would make the collective's in-place writes illegal.
        local = self.model.get_parameter(slot.name).to_local().detach()
        if self.compute_device is not None:
            local = local.to(self.compute_device)
        if local.shape[0] == slot.rows:
            return local.to(slot.dtype).contiguous().view(-1)
        padded = torch.empty(slot.local_numel, dtype=slot.dtype, device=local.device)
        padded[: local.numel()].copy_(local.reshape(-1))  # the padding rows are never read back
        return padded

    def _slots(self, k: int) -> list[_Slot]:
        """Unit k's flat-gathered parameters this sync gathers (all, or those selected)."""
        select = self._select
        return [s for s in self._visits[k].slots if select is None or s.name in select]

    def _prepare(self, k: int) -> list[torch.Tensor]:
        """This rank's shards of unit k's flat-gathered parameters, in slot order (this rank's own work)."""
        return [self._local(slot) for slot in self._slots(k)]

    def _placeholder(self, slot: _Slot) -> torch.Tensor:
        device = self.compute_device or self.model.get_parameter(slot.name).to_local().device
        return torch.empty(slot.local_numel, dtype=slot.dtype, device=device)

    def _start(self, k: int) -> list[tuple[_Slot, _InFlight]]:
        visit = self._visits[k]
        if visit.mesh is None or visit.mesh.size() == 1:  # nothing to gather: `_finish` reads the local shards
            return []
        world, group = visit.mesh.size(), visit.mesh.get_group()
        # This rank's own work first, then every collective of the unit: a failure of the former must not leave a
        # unit's collectives half-launched (the rest would pair with the next unit's on the other ranks).
        slots = self._slots(k)
        shards = self._latch.attempt(lambda: self._prepare(k), [slot.name for slot in slots])
        if shards is None:  # this rank failed: join the all-gathers with placeholders of the same sizes
            shards = [self._placeholder(slot) for slot in slots]
        started: list[tuple[_Slot, _InFlight]] = []
        for slot, local in zip(slots, shards, strict=True):
            # NOTE: one output per parameter, not one per unit: a consumer still holding a unit's last tensor
            # while it asks for the next unit then pins one parameter, not the whole unit.
            out = torch.empty(world * local.numel(), dtype=slot.dtype, device=local.device)
            work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
            started.append((slot, _InFlight(work, out, self._settle)))
        return started

    def _full(self, k: int, outs: list[tuple[_Slot, torch.Tensor]]) -> dict[str, torch.Tensor]:
        visit = self._visits[k]
        if visit.mesh is not None and visit.mesh.size() == 1:  # the local shards are the full tensors
            return {s.name: self.model.get_parameter(s.name).to_local().detach().to(s.dtype) for s in self._slots(k)}
        return {slot.name: out[: slot.shape[0] * slot.row_numel].view(slot.shape) for slot, out in outs}

    def _finish(
        self, k: int, pending: list[tuple[_Slot, _InFlight]], meter: MemoryMeter
    ) -> Iterator[tuple[str, torch.Tensor]]:
        visit = self._visits[k]
        outs = [(slot, in_flight.wait(self._timeout)) for slot, in_flight in pending]
        pending.clear()
        full = self._latch.run(functools.partial(self._full, k, outs)) or {}
        del outs
        others = set(visit.others)
        select = self._select
        for name in visit.names:
            if select is not None and name not in select:
                continue
            if name in others:  # materialised one by one (a collective for DTensors: runs after a failure too)
                tensor = _full_tensor(self.model.get_parameter(name), self.compute_device, meter)
                if not self._latch.failed:
                    yield name, tensor
                del tensor
            elif not self._latch.failed:
                yield name, full.pop(name)

    def trainable(self) -> frozenset[str]:
        return fsdp2_trainable(self.model, self._specs)

    def iter_full(self, meter: MemoryMeter, select: frozenset[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        self._latch.reset()
        self._select = select

        def start(k: int) -> list[tuple[_Slot, _InFlight]]:
            started = self._start(k)
            for _, pending in started:
                meter.hold_until_freed(pending.out)
            return started

        def finish(k: int, pending: list[tuple[_Slot, _InFlight]]) -> Iterator[tuple[str, torch.Tensor]]:
            return self._finish(k, pending, meter)

        visits = [k for k, v in enumerate(self._visits) if select is None or any(n in select for n in v.names)]
        sizes = [
            sum(v.mesh.size() * s.local_numel * s.dtype.itemsize for s in self._slots(k)) if v.slots else 0
            for k, v in enumerate(self._visits)
        ]
        yield from _pipelined(visits, start, finish, sizes, self.prefetch_bytes, self._latch)


def _flat_gatherable(param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and param.device_mesh.ndim == 1
        and tuple(param.placements) == (Shard(0),)
        and param.ndim >= 1
    )
