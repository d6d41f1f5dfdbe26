"""The patches of sparse syncs, as they travel: a patch (the changed elements of one tensor, by flat index into the
full tensor), every rank's change counts, and the collectives that join every rank's patches, in the encoding of
`fsdp_sync.patch_codec` (the one the gloo backend's patch round sends to a server). The decisions that read the
counts (what goes whole) are `fsdp_sync.sync.sparse`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_sync.compat.manifest import PlannedTensor
from fsdp_sync.compat.patch_api import EnginePatch

# NOTE: the codec is the bottom floor's (`fsdp_sync.patch_codec`), shared with the gloo backend; re-exported here.
from ..patch_codec import decode_indices, decode_patch, encode_indices, encode_patch, index_blocks
from ..distributed import collective


__all__ = [
    "Counts",
    "Exchanged",
    "Joined",
    "Packed",
    "Patch",
    "SparseRound",
    "count_changes",
    "decode_indices",
    "decode_patch",
    "encode_indices",
    "encode_patch",
    "exchange_counts",
    "exchange_patches",
    "gather_patches",
    "index_blocks",
    "local_counts",
    "pack_patches",
    "unpack_patches",
]

@dataclass(frozen=True)
class Patch:
    """The changed elements of one tensor: flat indices into the full tensor, ascending, and their new values.

    Attributes:
        nan: whether a value is NaN, where the extraction found it on the way (None: look at `values`).
    """

    indices: torch.Tensor
    values: torch.Tensor
    nan: bool | None = None

    @property
    def count(self) -> int:
        return self.indices.numel()


@dataclass(frozen=True)
class SparseRound:
    """One sparse sync's plan and payload.

    Attributes:
        dense: the planned tensors sent whole this time, in stream order.
        patches: the patches, on the ranks that push (colocate: every rank; server mode: rank 0).
        patched_tensors: how many tensors travel as patches (on every rank).
        diffed_elements: the elements of every tensor diffed (patched or sent whole after the diff).
        changed_elements: the changed elements among them.
        patched_elements: the elements of the tensors sent as patches.
        wire_bytes: bytes of the patch collectives as one rank receives them.
        encoded_bytes: the patches as an engine receives them (`patch_codec`'s segments), one whole copy.
    """

    dense: tuple[PlannedTensor, ...]
    patches: tuple[EnginePatch, ...]
    patched_tensors: int
    diffed_elements: int
    changed_elements: int
    patched_elements: int
    wire_bytes: int
    encoded_bytes: int = 0

    @property
    def patched_share(self) -> float:
        """Of the diffed elements, the share sent as patches (not whole)."""
        return self.patched_elements / self.diffed_elements if self.diffed_elements else 1.0


@dataclass(frozen=True)
class Counts:
    """How many elements of each tensor changed, per rank, and whether any new value is NaN; known on every rank, so
    every rank makes the same decisions from it (which tensors travel as patches, which whole).

    Attributes:
        names: the tensors, in the same order on every rank.
        per_rank: changed elements, `[world, len(names)]` (int64, CPU).
        nan: per tensor, whether some rank's new values hold a NaN (vLLM's patch loader reads NaN as "unchanged").
    """

    names: tuple[str, ...]
    per_rank: torch.Tensor
    nan: tuple[bool, ...]

    @property
    def totals(self) -> list[int]:
        return self.per_rank.sum(dim=0).tolist()

    def subset(self, keep: Sequence[str]) -> Counts:
        """The counts of `keep` (a sub-sequence of `names`), in that order."""
        index = {n: i for i, n in enumerate(self.names)}
        ids = [index[n] for n in keep]
        return Counts(tuple(keep), self.per_rank[:, ids], tuple(self.nan[i] for i in ids))


def count_changes(
    names: Sequence[str], local: dict[str, Patch], *, group: dist.ProcessGroup | None = None
) -> Counts:
    """Every rank's number of changes of each tensor and whether any new value is NaN: one all-gather."""
    return exchange_counts(names, local_counts(names, local), group=group)


def local_counts(names: Sequence[str], local: dict[str, Patch]) -> torch.Tensor:
    """This rank's row per tensor: (changed elements, whether a new value is NaN), `[len(names), 2]` int64; local
    work, for `exchange_counts`."""
    device = next((p.indices.device for p in local.values()), torch.device("cpu"))
    rows = [[local[n].count, _has_nan(local[n])] if n in local else [0, 0] for n in names]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


def exchange_counts(names: Sequence[str], mine: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> Counts:
    """Every rank's `local_counts`, on every rank: one all-gather (a sync runs it on its own group:
    `Coordinator.run`)."""
    if _single(group):
        both = mine.cpu().unsqueeze(0)
    else:
        world = dist.get_world_size(group)
        mine = _on_wire(mine, group)
        out = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
        collective("patch.counts", dist.all_gather_into_tensor, out, mine.reshape(-1), group=group)
        both = out.view(world, len(names), 2).cpu()
    return Counts(tuple(names), both[:, :, 0], tuple(bool(x) for x in both[:, :, 1].amax(dim=0).tolist()))


def _has_nan(patch: Patch) -> int:
    return int(patch.nan) if patch.nan is not None else int(torch.isnan(patch.values).any())


def _single(group: dist.ProcessGroup | None) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


def _on_wire(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`tensor` where `group`'s backend takes it: host memory for gloo (the sync's own groups are gloo, also on GPU
    trainers: a sparse round's counts and patches are small, and a group of its own can be aborted)."""
    return tensor.cpu() if dist.get_backend(group) == "gloo" else tensor


@dataclass(frozen=True)
class Joined:
    """Every rank's patches, joined.

    Attributes:
        totals: the changed elements of each tensor over all ranks (on every rank: the same decisions everywhere).
        patches: the patch of each changed tensor, on the ranks that receive them (indices ascending within each
            rank's part, the parts in rank order).
        wire_bytes: the bytes of the patch collectives' buffers (padding included), as one rank receives them.
    """

    totals: list[int]
    patches: dict[str, Patch]
    wire_bytes: int


@dataclass(frozen=True)
class Packed:
    """This rank's patches encoded for the patch gathers (`pack_patches`; local work, so a failure in it is said at
    a status round before any rank enters the gathers).

    Attributes:
        names, dtypes, numels: as `gather_patches` was given them.
        counts: every rank's counts of exactly `names`.
        order: the indices of the tensors some rank changed (the others travel not at all).
        low: this rank's indices' low 16 bits, every changed tensor in `order`, as float16 bits (gloo has no int16
            collective, and an all-gather only copies bytes).
        blocks: this rank's changes per block of 2**16 elements, every changed tensor in `order`.
        values: this rank's new values, per value dtype.
    """

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    numels: tuple[int, ...]
    counts: Counts
    order: tuple[int, ...]
    low: torch.Tensor
    blocks: torch.Tensor
    values: dict[torch.dtype, torch.Tensor]


def pack_patches(
    names: Sequence[str],
    local: dict[str, Patch],
    dtypes: Sequence[torch.dtype],
    numels: Sequence[int],
    counts: Counts,
) -> Packed:
    """Encode this rank's patches of `names` for `exchange_patches` (local work)."""
    if counts.names != tuple(names):
        raise ValueError("gather_patches: `counts` must be of exactly `names`, in order (Counts.subset)")
    device = next((p.indices.device for p in local.values()), torch.device("cpu"))
    order = tuple(i for i, t in enumerate(counts.totals) if t)
    empty_index = torch.empty(0, dtype=torch.int64, device=device)
    lows, blocks, values = [], [], {kind: [] for kind in sorted(set(dtypes), key=str)}
    for i in order:
        patch = local.get(names[i])
        indices = patch.indices if patch is not None else empty_index
        low16, per_block = encode_indices(indices, numels[i])
        lows.append(low16)
        blocks.append(per_block)
        if patch is not None:
            values[dtypes[i]].append(patch.values)
    low = torch.cat(lows) if lows else torch.empty(0, dtype=torch.int16, device=device)
    return Packed(
        tuple(names),
        tuple(dtypes),
        tuple(numels),
        counts,
        order,
        low.view(torch.float16),
        torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.int32, device=device),
        {
            kind: torch.cat(parts) if parts else torch.empty(0, dtype=kind, device=device)
            for kind, parts in values.items()
        },
    )


@dataclass(frozen=True)
class Exchanged:
    """Every rank's packed patches, as the patch gathers delivered them (empty lists on ranks that receive none)."""

    low: list[torch.Tensor]
    blocks: list[torch.Tensor]
    values: dict[torch.dtype, list[torch.Tensor]]
    wire_bytes: int


def exchange_patches(packed: Packed, *, to_all: bool, group: dist.ProcessGroup | None = None) -> Exchanged:
    """The patch gathers: the indices' low bits, the changes per block, and the values (one per value dtype); a sync
    runs them on its own group (`Coordinator.run`). What arrives is on the device of `packed`."""
    world = 1 if _single(group) else dist.get_world_size(group)
    per_rank = packed.counts.per_rank
    lengths = per_rank.sum(dim=1).tolist() if packed.order else [0] * world
    low = [t.view(torch.int16) for t in _gather_padded(packed.low, lengths, to_all, group)]
    blocks = _gather_padded(packed.blocks, [packed.blocks.numel()] * world, to_all, group)
    wire = world * (max(lengths) * 2 + packed.blocks.numel() * 4)
    values: dict[torch.dtype, list[torch.Tensor]] = {}
    for kind, flat in packed.values.items():
        ids = [i for i in packed.order if packed.dtypes[i] == kind]
        kind_lengths = per_rank[:, ids].sum(dim=1).tolist() if ids else [0] * world
        values[kind] = _gather_padded(flat, kind_lengths, to_all, group)
        wire += world * max(kind_lengths) * kind.itemsize
    return Exchanged(low, blocks, values, wire)


def unpack_patches(packed: Packed, exchanged: Exchanged, *, receive: bool) -> Joined:
    """Every rank's patches decoded from the gathers (local work; `receive`: this rank received them)."""
    totals = packed.counts.totals
    if not receive:
        return Joined(totals, {}, exchanged.wire_bytes)
    names, numels, per_rank = packed.names, packed.numels, packed.counts.per_rank
    patches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {names[i]: [] for i in packed.order}
    for r in range(len(exchanged.blocks)):
        value_at = dict.fromkeys(exchanged.values, 0)
        low_at = block_at = 0
        for i in packed.order:
            n, nblocks = int(per_rank[r, i]), index_blocks(numels[i])
            per_block = exchanged.blocks[r][block_at : block_at + nblocks]
            block_at += nblocks
            if not n:
                continue
            kind = packed.dtypes[i]
            indices = decode_indices(exchanged.low[r][low_at : low_at + n], per_block)
            patches[names[i]].append((indices, exchanged.values[kind][r][value_at[kind] : value_at[kind] + n]))
            low_at += n
            value_at[kind] += n
    joined = {
        name: Patch(torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts]))
        for name, parts in patches.items()
    }
    return Joined(totals, joined, exchanged.wire_bytes)


def gather_patches(
    names: Sequence[str],
    local: dict[str, Patch],
    dtypes: Sequence[torch.dtype],
    numels: Sequence[int],
    *,
    to_all: bool,
    group: dist.ProcessGroup | None = None,
    counts: Counts | None = None,
) -> Joined:
    """Every rank's patches of `names`, joined, in four collectives whatever the number of tensors: the counts
    (`count_changes`, unless given), the changes per block of 2**16 elements, the indices' low 16 bits, and the
    values (one per value dtype). `pack_patches`, `exchange_patches` and `unpack_patches` in one call.

    Args:
        names: the tensors, in the same order on every rank.
        local: this rank's patch of each name (a name without one has no change here; others are ignored).
        dtypes: each name's value dtype (the engine dtype for floating tensors).
        numels: each name's full element count.
        to_all: every rank receives every patch (colocate: one engine per rank); else rank 0 only (server mode:
            it alone talks to the server), and the others receive none.
        counts: `count_changes` of exactly `names` (`Counts.subset`), when the caller read them first to decide
            what travels as patches.
    """
    if counts is None:
        counts = count_changes(names, local, group=group)
    packed = pack_patches(names, local, dtypes, numels, counts)
    exchanged = exchange_patches(packed, to_all=to_all, group=group)
    me = 0 if _single(group) else dist.get_rank(group)
    return unpack_patches(packed, exchanged, receive=to_all or me == 0)


def _gather_padded(
    flat: torch.Tensor, lengths: list[int], to_all: bool, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Each rank's `flat` (lengths known everywhere), padded to the longest for one collective."""
    if len(lengths) == 1:
        return [flat]
    longest = max(lengths)
    if longest == 0:
        return [flat.new_empty(0) for _ in lengths]
    padded = _on_wire(flat.new_zeros(longest), group)
    padded[: flat.numel()] = flat
    world = len(lengths)
    if to_all:
        out = padded.new_empty(world * longest)
        collective("patch.gather", dist.all_gather_into_tensor, out, padded, group=group)
        return [out[r * longest : r * longest + n].to(flat.device) for r, n in enumerate(lengths)]
    # NOTE: `gather` to rank 0 (server mode): the other ranks need none of it.
    me = dist.get_rank(group)
    chunks = [padded.new_empty(longest) for _ in range(world)] if me == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    collective("patch.gather", dist.gather, padded, chunks, dst=dst, group=group)
    if chunks is None:
        return [flat.new_empty(0) for _ in lengths]
    return [c[:n].to(flat.device) for c, n in zip(chunks, lengths, strict=True)]

