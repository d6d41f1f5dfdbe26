"""FSDP1 (`FullyShardedDataParallel`) gatherers: flat (the default: one all-gather of each unit's flat-parameter
shard in the engine dtype), per-unit summon, and single root summon.

The seed bug: TRL walks the FSDP units child-first and calls `summon_full_params(unit, recurse=False)` on each. Before
the model's first forward no unit has been lazily initialised, so the first summoned child marks *itself* as root;
the real root's first forward then fails with "Non-root FSDP instance's `_is_root` should not have been set yet or
should have been set to `False`". TRL also never summons the root unit itself, so the root's own parameters
(embeddings, final norm) are never pushed.

The fix here, without a whole-model gather: walk the units parent-first. The first unit summoned is the root, and
summoning it runs FSDP's lazy initialisation from the true root, which marks every nested unit non-root. After that,
summoning one unit at a time is what FSDP expects, before or after the first forward, and peak memory is one unit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Sequence
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from fsdp_sync.compat.manifest import TensorSpec

from ..distributed import Rounds, rank
from ..faults import fault_point
from ..memory import MemoryMeter
from .base import HeldPieces, Piece, group_units, replica_piece, sync_rounds, until_failed as _until_failed
from .collectives import FlatBase, FlatOptions, InFlight, gather_dtype, launch_or_join, pipelined

__all__ = ["FSDP1FlatGatherer", "FSDP1RootSummonGatherer", "FSDP1UnitGatherer", "fsdp1_units"]

_WRAPPED = "_fsdp_wrapped_module"


def fsdp1_units(model: nn.Module) -> list[tuple[str, FSDP]]:
    """All FSDP1 units with their paths, parents before children (`named_modules` is pre-order)."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, FSDP)]


def _is_ancestor(candidate: str, path: str) -> bool:
    return candidate != path and (candidate == "" or path.startswith(candidate + "."))


def _unit_param_names(path: str, unit: FSDP) -> list[tuple[str, str, TensorSpec]]:
    """(trainer name, fqn inside the wrapped module, full spec) of the parameters the unit manages itself.

    NOTE: FSDP1 has no public API that gives full parameter shapes without an all-gather. Its `FlatParameter`
    records them (`_fqns`, `_shapes`, one dtype per flat parameter); these fields are unchanged from torch 2.0 to
    2.13, and FSDP1 is frozen in favour of FSDP2. Tied parameters are in `_shared_param_infos`, not `_fqns`, so each
    is listed once.
    """
    flat = unit._flat_param
    if flat is None:  # a unit that manages no parameters
        return []
    base = f"{path}.{_WRAPPED}" if path else _WRAPPED
    return [
        (f"{base}.{fqn}", fqn, TensorSpec(tuple(shape), flat.dtype))
        for fqn, shape in zip(flat._fqns, flat._shapes, strict=True)
    ]


def _ignored_params(model: nn.Module, units: list[tuple[str, FSDP]]) -> list[tuple[str, nn.Parameter]]:
    """Parameters FSDP does not manage (`ignored_modules` / `ignored_states`); they are full on every rank."""
    ignored: set[int] = set()
    for _, unit in units:
        ignored.update(id(p) for p in getattr(unit, "_ignored_params", ()))
    return [(n, p) for n, p in model.named_parameters() if id(p) in ignored]


class _FSDP1Base:
    def __init__(self, model: nn.Module, *, merge_scopes: tuple[type, ...] = ()) -> None:
        self.model = model
        self.units = fsdp1_units(model)
        if not self.units:
            raise ValueError(f"{type(model).__name__} contains no FullyShardedDataParallel unit")
        by_path = {path: (unit, _unit_param_names(path, unit)) for path, unit in self.units}
        groups = group_units(model, [path for path, _ in self.units], merge_scopes)
        # One visit per group: the units summoned together and their (name, fqn, spec) lists, in yield order.
        self._visits: list[list[tuple[FSDP, list[tuple[str, str, TensorSpec]]]]] = [
            [by_path[main]] + [by_path[c] for c in companions] for main, companions in groups
        ]
        self._ignored = _ignored_params(model, self.units)
        # NOTE: by name once, not a module walk per sync (measured at 7B shapes on the H200: 2-3 ms a sync): FSDP1
        # keeps the original parameter objects for the module's lifetime and swaps only their data.
        self._originals = dict(model.named_parameters())

    def specs(self) -> dict[str, TensorSpec]:
        out = {name: spec for visit in self._visits for _, params in visit for name, _, spec in params}
        out.update({name: TensorSpec(tuple(p.shape), p.dtype) for name, p in self._ignored})
        return out

    @staticmethod
    def _read(unit: FSDP, fqn: str) -> torch.Tensor:
        # Inside summon_full_params the original parameters are registered on their modules as full views.
        return reduce(getattr, fqn.split("."), unit._fsdp_wrapped_module).detach()

    def _iter_visit(
        self, visit: list[tuple[FSDP, list[tuple[str, str, TensorSpec]]]], select: frozenset[str] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for unit, params in visit:
            for name, fqn, _ in params:
                if select is None or name in select:
                    yield name, self._read(unit, fqn)

    def _selected(self, visit: list[tuple[FSDP, list[tuple[str, str, TensorSpec]]]], select: frozenset[str] | None) -> bool:
        return select is None or any(name in select for _, params in visit for name, _, _ in params)

    def _iter_ignored(self, select: frozenset[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._ignored:
            if select is None or name in select:
                yield name, p.detach()

    def trainable(self) -> frozenset[str]:
        # With `use_orig_params` the original parameters carry their own flag; a flat parameter's covers its unit.
        originals = self._originals
        names = set()
        for visit in self._visits:
            for unit, params in visit:
                flat = unit._flat_param
                for name, _, _ in params:
                    param = originals.get(name)
                    if (param.requires_grad if param is not None else flat is not None and flat.requires_grad):
                        names.add(name)
        names.update(name for name, p in self._ignored if p.requires_grad)
        return frozenset(names)

    def _slices(self, wanted: frozenset[str] | None) -> Iterator[tuple[FSDP, str, torch.Tensor, Any]]:
        """(unit, trainer name, the unit's local flat shard, the parameter's shard info) of each managed parameter.

        NOTE: each original parameter's slice of the local flat shard is in the flat parameter's `_shard_param_infos`
        (aligned with `_fqns`; unchanged since torch 2.0), the metadata FSDP's own sharded state dict uses; it also
        gives where the slice starts in the flattened full parameter (`intra_param_start_idx`).
        """
        for visit in self._visits:
            for unit, params in visit:
                flat = unit._flat_param
                if flat is None:
                    continue
                local = flat.detach()
                for (name, _, _), info in zip(params, flat._shard_param_infos, strict=True):
                    if wanted is None or name in wanted:
                        yield unit, name, local, info

    def local_shards(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = None if names is None else frozenset(names)
        for _, name, local, info in self._slices(wanted):
            if info.in_shard:
                yield name, local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            else:
                yield name, local[:0]
        yield from self._iter_ignored(wanted)

    def local_pieces(self, names: Iterable[str]) -> Iterator[Piece]:
        wanted = frozenset(names)
        owners: dict[int, bool] = {}
        for unit, name, local, info in self._slices(wanted):
            owner = owners.get(id(unit))
            if owner is None:  # once per unit, not per parameter
                owner = owners[id(unit)] = _owns_replica(unit)
            if info.in_shard and owner:
                piece = local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                yield Piece(name, piece, info.intra_param_start_idx)
            else:
                yield Piece(name, local[:0], 0)
        for name, p in self._ignored:
            if name in wanted:  # full on every rank: rank 0 reports it
                yield replica_piece(name, p, rank() == 0)

    def held_pieces(self, names: Sequence[str]) -> HeldPieces:
        index = {name: i for i, name in enumerate(names)}
        places: list[tuple[int, int, int]] = []
        runs: list[list[Any]] = []  # [flat parameter, offset in its local shard, count]: consecutive pieces merged
        owners: dict[int, bool] = {}
        for unit, name, _, info in self._slices(frozenset(names)):
            owner = owners.get(id(unit))
            if owner is None:
                owner = owners[id(unit)] = _owns_replica(unit)
            if not (owner and info.in_shard and info.numel_in_shard):
                continue
            places.append((index[name], info.intra_param_start_idx, info.numel_in_shard))
            flat = unit._flat_param
            if runs and runs[-1][0] is flat and runs[-1][1] + runs[-1][2] == info.offset_in_shard:
                runs[-1][2] += info.numel_in_shard
            else:
                runs.append([flat, info.offset_in_shard, info.numel_in_shard])
        whole = [(index[name], p) for name, p in self._ignored if name in index and p.numel()] if rank() == 0 else []
        places += [(i, 0, p.numel()) for i, p in whole]
        return HeldPieces(tuple(places), _ShardRuns([tuple(run) for run in runs], [p for _, p in whole]))


class _ShardRuns:
    """`HeldPieces.read` of FSDP1 pieces: views of the units' local flat shards (one per run of consecutive pieces),
    made once and again only after a unit's shard moved to other storage; then the ignored parameters, whole.

    NOTE: FSDP1 keeps each unit's local shard in one storage for the module's lifetime (the optimizer updates it in
    place; `flat_param.data` is set back to it after every unshard), so the views stay valid; the storage's
    address is compared at each read (one per unit, not per piece), so a shard that did move is never read stale.
    """

    def __init__(self, runs: list[tuple[Any, int, int]], whole: list[torch.Tensor]) -> None:
        self._runs = runs
        self._flats = list({id(flat): flat for flat, _, _ in runs}.values())
        self._whole = whole
        self._at: list[int] | None = None
        self._views: list[torch.Tensor] = []

    def __call__(self) -> list[torch.Tensor]:
        at = [flat.data_ptr() for flat in self._flats]
        if at != self._at:
            self._views = [flat.detach()[offset : offset + count] for flat, offset, count in self._runs]
            self._at = at
        return [*self._views, *self._whole]


def _owns_replica(unit: FSDP) -> bool:
    """Whether this rank reports its shard of the unit: always under FULL_SHARD / SHARD_GRAD_OP; under NO_SHARD the
    flat parameter is whole on every rank (rank 0 of the unit's group reports it); under the hybrid strategies the
    shard is replicated across nodes (the ranks of the first replica report it)."""
    handle = unit._handle
    if handle is None:
        return False
    if not handle.uses_sharded_strategy:
        return dist.get_rank(handle.process_group) == 0 if dist.is_initialized() else True
    hybrid = unit.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    return not hybrid or dist.get_rank(unit._inter_node_pg) == 0


def _visit_bytes(visit: list[tuple[FSDP, list[tuple[str, str, TensorSpec]]]]) -> int:
    return sum(spec.nbytes for _, params in visit for _, _, spec in params)


class FSDP1UnitGatherer(_FSDP1Base):
    """One unit full at a time, parents first (peak: the largest unit). Safe before the first forward."""

    strategy = "fsdp1-unit"
    tensors_outlive_step = False

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        run = sync_rounds(rounds)
        # NOTE: before the root's lazy initialisation (its first forward or summon) the root unit is summoned even
        # when none of its parameters is selected: summoning a nested unit first is the seed bug. FSDP1 records it
        # in `_is_root` (None until initialised; torch 2.0-2.13).
        root_pending = self._visits[0][0][0]._is_root is None
        for i, visit in enumerate(self._visits):
            if not self._selected(visit, select) and not (i == 0 and root_pending):
                continue
            # A round before each summon (FSDP's own all-gather, which a rank must not be left alone in).
            run.attempt("gather", lambda: fault_point("gather.prepare", unit=i, units=len(self._visits)))
            if not run.go_on():
                return
            nbytes = _visit_bytes(visit)
            with contextlib.ExitStack() as stack:
                # NOTE: the first unit is the root; summoning it first runs the lazy init from the true root (see
                # module docstring). recurse=False keeps nested units sharded; writeback=False: nothing is modified.
                for unit, _ in visit:
                    stack.enter_context(FSDP.summon_full_params(unit, recurse=False, writeback=False))
                meter.hold(nbytes)
                try:
                    yield from _until_failed(run, self._iter_visit(visit, select))
                finally:
                    meter.release(nbytes)
        if run.go_on():
            yield from _until_failed(run, self._iter_ignored(select))


class FSDP1RootSummonGatherer(_FSDP1Base):
    """The whole model full at once on every rank (`summon_full_params(root, recurse=True)`); peak: the model."""

    strategy = "fsdp1-root"
    tensors_outlive_step = True  # all storage stays alive until the generator is exhausted

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        run = sync_rounds(rounds)
        paths = [p for p, _ in self.units]
        roots = [unit for path, unit in self.units if not any(_is_ancestor(q, path) for q in paths)]
        nbytes = sum(_visit_bytes(visit) for visit in self._visits)
        run.attempt("gather", lambda: fault_point("gather.prepare", unit=0, units=1))
        if not run.go_on():  # a round before the summon (FSDP's own all-gathers)
            return
        with contextlib.ExitStack() as stack:
            for root in roots:
                stack.enter_context(FSDP.summon_full_params(root, recurse=True, writeback=False))
            meter.hold(nbytes)
            try:
                for visit in self._visits:
                    yield from _until_failed(run, self._iter_visit(visit, select))
                yield from _until_failed(run, self._iter_ignored(select))
            finally:
                meter.release(nbytes)


@dataclass
class _Gather:
    """One prepared all-gather: this rank's shard, the output buffer (None: the shard is the full tensor), group."""

    local: torch.Tensor
    out: torch.Tensor | None
    group: dist.ProcessGroup | None


class FSDP1FlatGatherer(_FSDP1Base, FlatBase):
    """FSDP1: all-gather each unit's local flat-parameter shard, cast to the engine dtype, and unflatten it.

    NOTE: reads FSDP1's flat-parameter handle (`_handle.flat_param`, its process group and `_get_unflat_views`), the
    same metadata `summon_full_params` uses; FSDP1 is frozen (torch 2.0-2.13). A unit holding a parameter that
    `options.keep_dtype` names (what the PEFT merge reads) is gathered uncast.
    """

    strategy = "fsdp1-flat"
    tensors_outlive_step = True  # each unit's views keep their own freshly allocated buffer alive

    def __init__(self, model: nn.Module, options: FlatOptions | None = None) -> None:
        super().__init__(model)
        options = self._init_flat(options)
        self._units = [visit[0] for visit in self._visits]  # no companions without merge scopes
        # The cast before the gather is per flat parameter: a unit holding any parameter to keep uncast goes uncast.
        keep = options.keep_dtype
        self._engine_dtypes = [
            None if keep is not None and any(keep(n) for n, _, _ in params) else options.engine_dtype
            for _, params in self._units
        ]
        self._sizes = [
            sum(spec.numel * gather_dtype(spec.dtype, dtype).itemsize for _, _, spec in params)
            for (_, params), dtype in zip(self._units, self._engine_dtypes, strict=True)
        ]
        # Per unit: the address of its own flat parameter where this sync hands it on as it is (`_prepare`), and the
        # views of it made once (`_unflat_views`).
        self._own: dict[int, int | None] = {}
        self._views: dict[int, tuple[tuple[int, int], list[torch.Tensor]]] = {}

    def _prepare(self, k: int) -> _Gather | None:
        """This rank's shard of unit k, on the compute device, in the gather dtype, and the unit's output buffer
        (this rank's own work); None for a unit with nothing to gather."""
        fault_point("gather.prepare", unit=self._order[k], units=len(self._order))
        unit, params = self._units[k]
        handle = unit._handle
        if handle is None or not params:
            return None
        flat = handle.flat_param.detach()
        if self.options.compute_device is not None:
            flat = flat.to(self.options.compute_device)
        local = flat.to(gather_dtype(flat.dtype, self._engine_dtypes[k]))
        world = dist.get_world_size(handle.process_group) if handle.uses_sharded_strategy else 1
        own = world == 1 and local.data_ptr() == handle.flat_param.data_ptr()
        self._own[k] = local.data_ptr() if own else None
        if world == 1:  # the shard is the full flat parameter: no collective, no copy
            return _Gather(local, None, handle.process_group)
        out = torch.empty(local.numel() * world, dtype=local.dtype, device=local.device)
        self._meter.hold_until_freed(out)
        return _Gather(local.contiguous(), out, handle.process_group)

    def _launch(self, k: int, prepared: _Gather | None) -> InFlight | None:
        if prepared is None:
            return None
        if prepared.out is None:
            return InFlight(None, prepared.local)
        (work,) = launch_or_join(self._run, self._order[k], len(self._order), [(prepared.out, prepared.local)],
                                  prepared.group)  # fmt: skip
        return InFlight(work, prepared.out, self._settle)

    def _collect(self, k: int, pending: InFlight | None) -> list[tuple[str, torch.Tensor]]:
        if pending is None:
            return []
        full = pending.wait(self._timeout)
        fault_point("gather.unflatten", unit=self._order[k], units=len(self._order))
        unit, params = self._units[k]
        views = self._unflat_views(k, unit, full)
        select = self._select
        pairs = zip(params, views, strict=True)
        return [(name, view) for (name, _, _), view in pairs if select is None or name in select]

    def _unflat_views(self, k: int, unit: FSDP, full: torch.Tensor) -> list[torch.Tensor]:
        """Unit k's parameters as views of its full flat parameter `full`.

        NOTE: where `full` is the unit's own flat parameter (world size 1, nothing cast or moved: `_prepare`), its
        views are made once and kept while it stays at that address (the kept views hold its storage, so no other
        tensor can take that address meanwhile): FSDP's `_get_unflat_views`, one view per parameter, was about a
        third of this gatherer's host work per tensor, measured on the CPU. A fresh buffer (an all-gather's output,
        a cast) is viewed every time and never kept.
        """
        numel = unit._handle.flat_param._unpadded_unsharded_size.numel()
        if full.data_ptr() != self._own.get(k):
            return unit._handle._get_unflat_views(full[:numel])
        key = (full.data_ptr(), numel)
        kept = self._views.get(k)
        if kept is None or kept[0] != key:
            kept = self._views[k] = (key, unit._handle._get_unflat_views(full[:numel]))
        return kept[1]

    def iter_full(
        self, meter: MemoryMeter, select: frozenset[str] | None = None, rounds: Rounds | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._meter, self._select, self._run = meter, select, self._rounds(rounds)
        # NOTE: a flat parameter is gathered whole: a unit with any selected parameter is visited entire.
        visits = [k for k, (_, ps) in enumerate(self._units) if select is None or any(n in select for n, _, _ in ps)]
        self._order = {k: i for i, k in enumerate(visits)}  # position in this gather, for the fault points
        yield from pipelined(
            visits, self._prepare, self._launch, self._collect, self._sizes, self.options.prefetch_bytes, self._run
        )
        if not self._run.stopped and not self._run.failed:
            yield from self._iter_ignored(select)
