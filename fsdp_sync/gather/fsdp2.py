"""FSDP2 (`fully_shard`) gatherers: flat (the default: each parameter's local shard, cast to the engine dtype,
all-gathered straight into its full layout), per-unit unshard and per-parameter `full_tensor()`.

Per unit: `FSDPModule.unshard()` runs one grouped all-gather for all parameters of the unit (not recursive), the
unit's parameters become plain full tensors, and `reshard()` frees them. Per parameter: one all-gather per DTensor.
Plain tensors (ignored parameters, modules outside any unit) pass through both untouched.

Why one file (over 500 lines): one backend's gatherers, as `fsdp1.py` holds FSDP1's. The three strategies share the
readers of FSDP2's parameter records (`fsdp2_sharded_parameters`, `_local_tensor`) and the one-parameter gather
(`_full_tensor`, also the flat strategy's way for what it cannot gather flat); a file per strategy would import
those private helpers across files.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_sync.compat.manifest import TensorSpec
from fsdp_sync.compat.torch_api import fsdp2_param_groups

from ..distributed import Rounds, rank
from ..faults import fault_point
from ..memory import MemoryMeter
from .base import HeldPieces, Piece, group_units, local_named_parameters, replica_piece, spec_of, sync_rounds
from .collectives import FlatBase, FlatOptions, InFlight, gather_dtype, launch_or_join, pipelined

__all__ = [
    "FSDP2FlatGatherer",
    "FSDP2ParamGatherer",
    "FSDP2UnitGatherer",
    "fsdp2_held_pieces",
    "fsdp2_local_pieces",
    "fsdp2_local_shards",
    "fsdp2_sharded_parameters",
    "fsdp2_trainable",
    "fsdp2_units",
]


def fsdp2_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """All FSDP2 units with their paths, parents first."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, FSDPModule)]


def fsdp2_sharded_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every named parameter (as `named_parameters()` names them), with FSDP2's sharded DTensor for those a unit
    manages, whatever state the unit is in now.

    Why: an unsharded unit (the root after a forward: FSDP2 does not reshard the root until its backward) registers
    plain full parameters, whose storage it frees at the next reshard. Taken from `named_parameters()` then, the
    root's parameters were not recognised as shards: the flat gatherer materialised them with `full_tensor()` at
    every sync (an all-gather and a copy of the embedding; at 1.5B shapes on one H100, most of what FSDP2's complete
    sync took over FSDP1's), and a kept reference would have read freed storage.

    NOTE: reads FSDP2's private parameter records (`FSDPParam.sharded_param`, `_module_info`,
    `_shared_module_infos`; torch 2.4-2.13): there is no public map from a unit's parameters to its shards.
    """
    params = dict(model.named_parameters())
    path_of = {id(m): path for path, m in model.named_modules()}
    for _, unit in fsdp2_units(model):
        for group in fsdp2_param_groups(unit):
            for fsdp_param in group.fsdp_params:
                for info in (fsdp_param._module_info, *getattr(fsdp_param, "_shared_module_infos", ())):
                    path = path_of.get(id(info.module))
                    name = f"{path}.{info.param_name}" if path else info.param_name
                    if path is not None and name in params:
                        params[name] = fsdp_param.sharded_param
    return params


def _unshard_exact(unit: nn.Module, engine_dtype: torch.dtype | None) -> bool:
    """Whether `unshard()` yields values that, cast to the engine dtype, equal the cast full parameters: it gathers
    in each group's `MixedPrecisionPolicy.param_dtype`, which must then be unset or the engine dtype itself.

    NOTE: FSDP2 exposes no public getter for a unit's policy; its parameter groups hold it (see compat.torch_api).
    """
    if engine_dtype is None:
        return True
    return all(g.mp_policy.param_dtype in (None, engine_dtype) for g in fsdp2_param_groups(unit))


@torch.no_grad()
def _full_tensor(param: torch.Tensor, compute_device: torch.device | None, meter: MemoryMeter) -> torch.Tensor:
    """All-gather one DTensor (its shard moved to `compute_device` first, if given); plain tensors pass through."""
    if not isinstance(param, DTensor):
        return param.detach()
    if compute_device is not None:
        param = param.to(compute_device)
    full = param.full_tensor()
    meter.hold_until_freed(full)
    return full


def fsdp2_trainable(
    model: nn.Module, names: Iterable[str], params: dict[str, torch.Tensor] | None = None
) -> frozenset[str]:
    """The named parameters with `requires_grad` (a DTensor carries its parameter's flag); no module walk where the
    caller kept `params` by name (as `fsdp2_local_shards`)."""
    params = params if params is not None else dict(model.named_parameters())
    return frozenset(name for name in names if params[name].requires_grad)


def fsdp2_local_shards(
    model: nn.Module, names: Iterable[str], params: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's local shard of each named parameter (plain tensors as they are); no collective.

    NOTE: one walk of the module tree (`named_parameters`), or none where the caller kept `params` by name, not one
    `get_parameter` per name: measured on the H200 at 7B shapes, 900 lookups cost 31 ms, a third of the delta check.
    """
    params = params if params is not None else dict(model.named_parameters())
    # NOTE: under no_grad `to_local()` returns the local tensor itself (with grad it goes through an autograd
    # function, a few microseconds a parameter); taken in one block, as grad mode must not leak past a yield.
    with torch.no_grad():
        shards = [(name, _local_tensor(params[name])) for name in names]
    yield from shards


def fsdp2_local_pieces(
    model: nn.Module, names: Iterable[str], params: dict[str, torch.Tensor] | None = None
) -> Iterator[Piece]:
    """This rank's piece of each named parameter (see `Gatherer.local_pieces`); no collective.

    NOTE: where a DTensor's local shard lies in the full tensor comes from DTensor's own
    `compute_local_shape_and_global_offset` (what distributed checkpointing uses; private in torch 2.4-2.13). A
    shard is a contiguous run of the flattened tensor when it is sharded on dim 0 only (FSDP2's default); a
    replicated mesh dimension (HSDP) is reported by its first coordinate only.

    Raises:
        NotImplementedError: a parameter sharded otherwise (`shard_placement_fn` on another dim, tensor parallel),
            named; a sparse sync of it is not possible, so the caller syncs densely.
    """
    params = params if params is not None else dict(model.named_parameters())
    names = list(names)
    with torch.no_grad():  # as in `fsdp2_local_shards`
        local_of = {name: param.to_local().detach() for name in names if isinstance(param := params[name], DTensor)}
    for name in names:
        param = params[name]
        if not isinstance(param, DTensor):
            yield replica_piece(name, param, rank() == 0)
            continue
        local = local_of[name]
        place = _shard_place(tuple(param.shape), param.device_mesh, tuple(param.placements))
        if place is None:
            raise NotImplementedError(f"{name}: placements {param.placements} are not dim-0 shards; no sparse sync of it")
        local_shape, start, owner = place
        flat = local.reshape(-1)
        if not owner or not flat.numel():
            yield Piece(name, flat[:0], 0)
            continue
        if tuple(local.shape) != local_shape:
            raise NotImplementedError(f"{name}: local shard {tuple(local.shape)} is not the expected {local_shape}")
        yield Piece(name, flat, start)


def fsdp2_held_pieces(model: nn.Module, names: Sequence[str]) -> HeldPieces:
    """This rank's pieces of `names` laid out once (see `Gatherer.held_pieces`; the pieces `fsdp2_local_pieces`
    gives): each sync reads the sharded parameters' local tensors, nothing else.

    NOTE: FSDP2's sharded DTensors (`fsdp2_sharded_parameters`, whatever state each unit is in) are kept; a unit
    may give one a new local tensor (`reset_sharded_param`), so each one's local shard is read at every sync
    (`_shard`), never kept.

    Raises:
        NotImplementedError: as `fsdp2_local_pieces`, naming each parameter sharded other than on dim 0.
    """
    params = fsdp2_sharded_parameters(model)
    places: list[tuple[int, int, int]] = []
    held: list[torch.Tensor] = []
    for i, piece in enumerate(fsdp2_local_pieces(model, names, params)):
        if piece.values.numel():
            places.append((i, piece.start, piece.values.numel()))
            held.append(params[names[i]])

    def read() -> list[torch.Tensor]:
        return [_shard(p) for p in held]

    return HeldPieces(tuple(places), read)


@functools.lru_cache(maxsize=4096)
def _shard_place(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[tuple[int, ...], int, bool] | None:
    """Where this rank's shard of a DTensor of `shape` lies: (its local shape, its first element in the flattened
    full tensor, whether this rank reports it), or None where a placement is not a dim-0 shard or a replica.

    NOTE: kept per (shape, mesh, placements), which a plan's parameters share layer after layer: DTensor's own
    computation took about 0.1 ms a parameter, most of an adapter sync of many small tensors (392 LoRA weights on
    2 CPU ranks: 53 of its 108 ms), and it gives the same answer every sync.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)) for p in placements):
        return None
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    owner = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))
    return tuple(local_shape), offset[0] * math.prod(shape[1:]), owner


def _shard(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard as it is (a plain tensor: itself), out of autograd.

    NOTE: DTensor's `_local_tensor`, what `to_local()` returns under no_grad, read as the attribute DTensor flattens
    itself to (torch 2.4-2.13). `to_local()` costs microseconds a call (a grad-mode check and, since torch 2.13, a
    `view_as` that keeps parameter-ness): as much as the rest of an adapter sync's per-tensor work, and paid per
    parameter and sync by the flat gatherer. FSDP2's local shards never require grad (the DTensor parameter does).
    """
    return param._local_tensor if isinstance(param, DTensor) else param


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (a plain tensor as it is), detached."""
    return _shard(param).detach()


class FSDP2ParamGatherer:
    """One `full_tensor()` per sharded parameter (peak: one parameter).

    Args:
        model: the FSDP2 model.
        compute_device: where CPU-offloaded shards are moved before their all-gather (NCCL cannot gather CPU
            tensors); None when shards already live where the process group communicates.
    """

    strategy = "fsdp2-param"
    tensors_outlive_step = True  # every full tensor is a fresh allocation

    def __init__(self, model: nn.Module, *, compute_device: torch.device | None = None) -> None:
        self.model = model
        self.compute_device = compute_device

    def specs(self) -> dict[str, TensorSpec]:
        return {name: spec_of(p) for name, p in self.model.named_parameters()}

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # NOTE: one round before the first all-gather only: a round per parameter would cost a collective each.
        # A rank that fails later runs every remaining `full_tensor()` before the ranks agree (`fsdp_sync.sync.push.Push.run`).
        run = sync_rounds(rounds)
        run.attempt("gather", lambda: fault_point("gather.prepare", unit=0, units=1))
        if not run.go_on():
            return
        for name, param in self.model.named_parameters():
            if select is None or name in select:
                tensor = _full_tensor(param, self.compute_device, meter)
                if not run.failed:
                    yield name, tensor

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return fsdp2_local_shards(self.model, self.specs() if names is None else names)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        return fsdp2_local_pieces(self.model, names)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        return fsdp2_held_pieces(self.model, names)

    def trainable(self) -> frozenset[str]:
        return fsdp2_trainable(self.model, self.specs())


class FSDP2UnitGatherer:
    """One FSDP2 unit unsharded at a time, parents first (peak: the largest unit).

    Args:
        model: the FSDP2 model.
        engine_dtype: the engine's dtype. A unit whose mixed-precision all-gather dtype differs from both its
            parameters' and the engine's (e.g. bf16 gather, fp32 engine) would lose bits, so such a unit is gathered
            with `full_tensor()` in the parameter dtype instead; decided once per unit here.
        compute_device: as for `FSDP2ParamGatherer`, for parameters gathered with `full_tensor()`.
    """

    strategy = "fsdp2-unit"
    tensors_outlive_step = False  # reshard() frees the unit's full storage

    def __init__(
        self,
        model: nn.Module,
        *,
        engine_dtype: torch.dtype | None = None,
        compute_device: torch.device | None = None,
        merge_scopes: tuple[type, ...] = (),
    ) -> None:
        self.model = model
        self.compute_device = compute_device
        planned = dict(model.named_parameters())  # de-duplicated: a tied parameter keeps its first name
        units = fsdp2_units(model)
        if not units:
            raise ValueError(f"{type(model).__name__} contains no FSDP2 (fully_shard) unit")
        by_path = dict(units)
        # Parameters outside every unit belong to the top module; it is visited first and never unsharded.
        groups: list[tuple[str, list[str]]] = [] if isinstance(model, FSDPModule) else [("", [])]
        groups += group_units(model, [p for p, _ in units], merge_scopes)
        # (units unsharded together, names they yield in order); every planned name is yielded by exactly one visit.
        self._visits: list[tuple[list[nn.Module], list[str]]] = []
        emitted: set[str] = set()
        for main, companions in groups:
            members = [(p, by_path.get(p, model)) for p in [main, *companions]]
            names = [
                n
                for path, unit in members
                for n, _ in local_named_parameters(unit, path, FSDPModule)
                if n in planned and n not in emitted
            ]
            emitted.update(names)
            exact = all(_unshard_exact(unit, engine_dtype) for _, unit in members if isinstance(unit, FSDPModule))
            to_unshard = [unit for _, unit in members if isinstance(unit, FSDPModule)] if exact else []
            self._visits.append((to_unshard, names))
        self._specs = {n: spec_of(planned[n]) for _, names in self._visits for n in names}

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return fsdp2_local_shards(self.model, self._specs if names is None else names)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        return fsdp2_local_pieces(self.model, names)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        return fsdp2_held_pieces(self.model, names)

    def trainable(self) -> frozenset[str]:
        return fsdp2_trainable(self.model, self._specs)

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        run = sync_rounds(rounds)
        for k, (to_unshard, visit_names) in enumerate(self._visits):
            names = [n for n in visit_names if select is None or n in select]
            if not names:
                continue
            # A round before each unit's all-gathers (FSDP's own, or `full_tensor()`).
            run.attempt("gather", lambda: fault_point("gather.prepare", unit=k, units=len(self._visits)))
            if not run.go_on():
                return
            if not to_unshard:
                for name in names:
                    tensor = _full_tensor(self.model.get_parameter(name), self.compute_device, meter)
                    if not run.failed:  # a failed rank still runs the unit's collectives
                        yield name, tensor
                continue
            for unit in to_unshard:
                unit.unshard()
            try:
                # After unshard() the unit's own parameters are registered as plain full tensors.
                full = [(name, self.model.get_parameter(name)) for name in names]
                nbytes = sum(p.numel() * p.element_size() for _, p in full)
                meter.hold(nbytes)
                try:
                    for name, param in full:
                        tensor = _full_tensor(param, self.compute_device, meter)
                        if not run.failed:
                            yield name, tensor
                finally:
                    meter.release(nbytes)
            finally:
                for unit in to_unshard:
                    unit.reshard()


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
    world: int  # the mesh's size (1 without flat-gathered parameters), read once: `DeviceMesh.size()` costs ~7 us


class FSDP2FlatGatherer(FlatBase):
    """FSDP2: each parameter's local shard, cast to the engine dtype, all-gathered straight into its full layout
    (asynchronously, all of a unit's gathers in flight together, the next unit's started during the current push).

    FSDP2 shards dim 0 like `torch.chunk`: every rank holds at most `ceil(d0 / world)` rows, the short chunks last.
    Gathering `ceil(d0 / world)` rows from every rank (short shards padded) into a `world * ceil(d0 / world)`-row
    block therefore lays the full parameter out in order: its first `d0` rows, with no copy afterwards. Parameters
    that are not `Shard(0)` DTensors on a 1-D mesh (plain tensors, other layouts) are materialised one by one, as in
    the per-parameter strategy. Parameters `options.keep_dtype` names (what the PEFT merge reads) are gathered uncast.
    """

    strategy = "fsdp2-flat"
    tensors_outlive_step = True  # every full tensor is a view of its unit's fresh buffer (or a fresh tensor)

    def __init__(self, model: nn.Module, options: FlatOptions | None = None) -> None:
        options = self._init_flat(options)
        self._select: frozenset[str] | None = None
        self.model = model
        planned = fsdp2_sharded_parameters(model)
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
                kept = options.keep_dtype is not None and options.keep_dtype(name)
                wire = param.dtype if kept else gather_dtype(param.dtype, options.engine_dtype)
                slots.append(_Slot(name, rows, tuple(param.shape), wire))
            # Grouped by wire dtype, as the collectives are launched.
            slots.sort(key=lambda slot: str(slot.dtype))
            self._visits.append(_Visit(names, slots, others, mesh, mesh.size() if mesh is not None else 1))
        self._specs = {n: spec_of(planned[n]) for visit in self._visits for n in visit.names}
        # NOTE: decided once: where every flat-gathered shard already lives on the compute device (no CPU offload),
        # no `.to(device)` per parameter and sync (a microsecond or two of host work each, at 1.5B shapes a tenth of
        # FSDP2's host work over FSDP1's on one H100).
        self._move_to = options.compute_device
        if options.compute_device is not None:
            here = torch.empty(0, device=options.compute_device).device
            shards = [_local_tensor(planned[slot.name]) for visit in self._visits for slot in visit.slots]
            if all(shard.device == here for shard in shards):
                self._move_to = None

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return fsdp2_local_shards(self.model, self._specs if names is None else names, self._params)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        return fsdp2_local_pieces(self.model, names, self._params)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        return fsdp2_held_pieces(self.model, names)

    def _cast(self, local: torch.Tensor, slot: _Slot) -> torch.Tensor:
        """A local shard on the compute device, in the wire dtype (under `_prepare`'s no_grad)."""
        if self._move_to is not None:
            local = local.to(self._move_to)
        return local if local.dtype == slot.dtype else local.to(slot.dtype)

    def _local(self, slot: _Slot) -> torch.Tensor:
        """This rank's shard of one parameter as a 1-D tensor of `slot.rows` rows in its wire dtype (padded if
        short)."""
        # Detached: a tensor that required grad would make the collective's in-place writes illegal.
        local = _unlinked(_shard(self._params[slot.name]))
        if local.shape[0] == slot.rows:
            return self._cast(local, slot).contiguous().view(-1)
        if self.options.compute_device is not None:
            local = local.to(self.options.compute_device)
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
        world = visit.world
        # NOTE: one no_grad block for the unit, not one per parameter (a decorator costs microseconds a call).
        with torch.no_grad():
            if world == 1:  # the local shards are the full parameters, in their own shape: nothing to gather
                params = self._params
                return [(slot, self._cast(_unlinked(_shard(params[slot.name])), slot), None)
                        for slot in self._slots(k)]  # fmt: skip
            prepared: list[tuple[_Slot, torch.Tensor, torch.Tensor | None]] = []
            for slot in self._slots(k):
                local = self._local(slot)
                # NOTE: one output per parameter, not one per unit: a consumer still holding a unit's last tensor
                # while it asks for the next unit then pins one parameter, not the whole unit.
                out = torch.empty(world * local.numel(), dtype=slot.dtype, device=local.device)
                self._meter.hold_until_freed(out)
                prepared.append((slot, local, out))
            return prepared

    def _launch(
        self, k: int, prepared: list[tuple[_Slot, torch.Tensor, torch.Tensor | None]]
    ) -> list[tuple[_Slot, InFlight]] | list[tuple[_Slot, torch.Tensor, torch.Tensor | None]]:
        if self._visits[k].world == 1:  # nothing to gather: the local shards are the full parameters
            return prepared
        gathers = [(out, local) for _, local, out in prepared if out is not None]
        if not gathers:
            return [(slot, InFlight(None, local)) for slot, local, _ in prepared]
        works = launch_or_join(self._run, self._order[k], len(self._order), gathers, self._visits[k].mesh.get_group())
        pairs = zip(prepared, works, strict=True)
        return [(slot, InFlight(work, out, self._settle)) for (slot, _, out), work in pairs]

    def _collect(
        self, k: int, pending: list[tuple[_Slot, InFlight]] | list[tuple[_Slot, torch.Tensor, torch.Tensor | None]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Wait for unit k's all-gathers and return its full tensors in yield order; the parameters that are not
        flat-gathered are materialised here, before the round (each `full_tensor()` is a collective of its own)."""
        visit = self._visits[k]
        if visit.world == 1 and not visit.others:
            # NOTE: world size 1 (one GPU): the prepared local shards in yield order, with no wait or reshaping.
            # The general path below costs a few microseconds a parameter in Python; at 1.5B shapes on one H100
            # that was most of FSDP2's host work over FSDP1's.
            fault_point("gather.unflatten", unit=self._order[k], units=len(self._order))
            local = {slot.name: tensor for slot, tensor, _ in pending}  # type: ignore[misc]
            pending.clear()
            return [(name, local[name]) for name in visit.names if name in local]
        if visit.world == 1:
            pending = [(slot, InFlight(None, tensor)) for slot, tensor, _ in pending]  # type: ignore[misc]
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
                param = self.model.get_parameter(name)
                items.append((name, _full_tensor(param, self.options.compute_device, self._meter)))
        return items

    def trainable(self) -> frozenset[str]:
        return fsdp2_trainable(self.model, self._specs, self._params)

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._meter, self._select, self._run = meter, select, self._rounds(rounds)
        # Units that own no parameter this sync sends (accelerate's FSDP2 wrap has some) are not visited.
        visits = [k for k, v in enumerate(self._visits) if any(select is None or n in select for n in v.names)]
        self._order = {k: i for i, k in enumerate(visits)}  # position in this gather, for the fault points
        sizes = [
            sum(v.world * s.local_numel * s.dtype.itemsize for s in self._slots(k)) if v.slots else 0
            for k, v in enumerate(self._visits)
        ]
        limit = self.options.prefetch_bytes
        yield from pipelined(visits, self._prepare, self._launch, self._collect, sizes, limit, self._run)


def _unlinked(local: torch.Tensor) -> torch.Tensor:
    """`local` out of autograd. NOTE: FSDP2's local shards never require grad (the DTensor parameter does), so this
    is `local` itself: a `detach()` per parameter and sync cost 1.4 us each on an H100's host (0.5 ms at 1.5B)."""
    return local.detach() if local.requires_grad else local


def _flat_gatherable(param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and param.device_mesh.ndim == 1
        and tuple(param.placements) == (Shard(0),)
        and param.ndim >= 1
    )
