"""Send only what can have changed (`SyncConfig(delta=True)`, the default), and prove every sync that the rest did not.

Why: with LoRA or frozen parts (embeddings, a vision tower, lower layers), most weights cannot change between syncs,
yet a complete sync gathers and pushes them all. After one complete sync, a delta sync sends the tensors that can
change (trainable parameters; for PEFT the base weights that adapters merge into, and `modules_to_save` copies),
each widened to whole engine modules, and skips the rest. Skipping is only worth having if it is never wrong, so:

- **Proof, every sync.** Each rank fingerprints its own shards of every skipped parameter (on its device, no gather)
  and compares them with the fingerprints taken when those values were last pushed; the ranks agree on the union of
  what changed with one small collective, and a changed skipped parameter is sent (and logged by name).
- **Whole engine modules.** vLLM's layer-wise reload processes a layer once all of its weights arrived; a layer that
  receives part of its weights is processed from what it has at the end of the reload, the rest uninitialised
  (measured on vLLM 0.32: the v rows of a fused `qkv_proj` after a push of q_proj and k_proj alone; NaN in a fused
  MoE layer's `w2_weight` after a push of its experts' gate and up projections alone). So every checkpoint tensor
  that vLLM loads into the same module goes together: the engine model's `packed_modules_mapping` says which
  checkpoint modules one engine module fuses (`qkv_proj: [q_proj, k_proj, v_proj]`), and where the engine has no
  module at a checkpoint module's path, the indexed container it belongs to goes whole (every expert of
  `...mlp.experts.<i>.*`, which vLLM loads into one fused-experts module).
- **Complete when in doubt.** The first sync of a sync object, every sync after a failed one, and every sync after
  the trainable set changed (`requires_grad` flipped, adapters switched) are complete again.

The fingerprint of a tensor (`_fingerprint`) is computed where the tensor lives: the CRC-32 of its bytes on the CPU,
position-weighted integer sums of its bits on an accelerator (no copy to the host).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fsdp_sync.compat.engine_api import EngineLayout, EngineNaming
from fsdp_sync.compat.manifest import PlannedTensor

from . import bitsums
from .kernels import runtime as kernels
from .kernels.runtime import HostReadback

__all__ = ["DeltaTracker", "EngineGroups", "Fingerprinter", "Selection", "fingerprints", "nbytes"]

logger = logging.getLogger(__name__)

_PERIOD = 8191  # a prime: positions are weighted by (j mod _PERIOD) and by (j // _PERIOD)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A fingerprint of the tensor's raw bits, as three int64 values, computed where the tensor lives.

    On the CPU: the CRC-32 of its bytes (zlib; 10 ms for 60 MB measured on the 2-core test machine, against 60-70 ms
    for one int64 reduction pass there), which detects every change of one element up to 4 bytes wide and any other
    change but with probability 2^-32. On an accelerator (no copy to the host): three int64 sums over the bits x_j,
    sum(x_j), sum((j mod P) x_j) and sum((j // P) x_j); two swapped elements i != j leave all three equal only if
    i = j mod P and i // P = j // P, i.e. never, and any single changed element changes the first. On CUDA one
    Triton pass over all watched tensors (`fingerprints`, `fsdp_sync.bitsums`); elsewhere reductions over a (rows, P)
    view with int64 accumulation, so no int64 copy of the tensor is made.
    """
    return _crc_fingerprint(tensor) if tensor.device.type == "cpu" else _sum_fingerprint(tensor)


def _crc_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
    return torch.tensor([zlib.crc32(data), tensor.numel(), 0], dtype=torch.int64)


def _sum_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.view(torch.uint8)
    # NOTE: summed as 8-byte words where the size allows (native int64 sums, a quarter of the elements of bf16):
    # a changed element changes its word, and a swap within a word changes the word unless both are equal.
    if raw.numel() % 8 == 0:
        bits = raw.view(torch.int64)
    else:
        bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() or flat.is_complex() else flat
    rows = bits.numel() // _PERIOD
    main, tail = bits[: rows * _PERIOD].view(rows, _PERIOD), bits[rows * _PERIOD :]
    positions = _positions(bits.device, max(_PERIOD, rows))
    columns = main.sum(dim=0, dtype=torch.int64)  # per position mod P
    per_row = main.sum(dim=1, dtype=torch.int64)  # per row (j // P)
    tail64 = tail.to(torch.int64)
    return torch.stack(
        [
            columns.sum() + tail64.sum(),
            (columns * positions[:_PERIOD]).sum() + (tail64 * positions[: tail64.numel()]).sum(),
            (per_row * positions[:rows]).sum() + rows * tail64.sum(),
        ]
    )


_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _positions(device: torch.device, n: int) -> torch.Tensor:
    """0, 1, 2, ... (int64) on `device`, at least `n` long; kept between calls."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = _POSITIONS[device] = torch.arange(max(n, 2 * _PERIOD), dtype=torch.int64, device=device)
    return cached


class Fingerprinter:
    """Fingerprints of named tensors as one (n, 3) int64 tensor per call.

    Why a class: on CUDA every tensor of whole, aligned int64 words goes into one Triton launch
    (`fsdp_sync.bitsums`: the same values as `_sum_fingerprint`, one read of their bits) whose table of addresses is
    kept between calls, so a call's host work is a few integer reads per tensor; results stay on the device. The rest
    (the CPU's CRC-32, odd sizes, unaligned views) is fingerprinted one tensor at a time, as `_fingerprint`.
    """

    def __init__(self) -> None:
        self._sums = bitsums.BitSums(_PERIOD)

    def __call__(self, shards: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
        """The names, in order, and their fingerprints: one row each, on the tensors' device (the CPU if they are on
        several)."""
        names: list[str] = []
        others: list[tuple[int, torch.Tensor]] = []
        rows: list[int] = []
        held: list[torch.Tensor] = []  # alive until the launch: their addresses are in its table
        addresses: list[int] = []
        sizes: list[int] = []
        device: torch.device | None = None
        for name, tensor in shards:
            where = tensor.device
            size = bitsums.words(tensor) if (where == device or device is None) and kernels.usable(where) else None
            if size is None:
                others.append((len(names), tensor))
            else:
                device = where
                rows.append(len(names))
                held.append(tensor)
                addresses.append(tensor.data_ptr())
                sizes.append(size)
            names.append(name)
        if not others:
            if device is None:
                return names, torch.empty(0, 3, dtype=torch.int64)
            return names, self._sums(addresses, sizes, device)
        prints: list[torch.Tensor] = [torch.empty(0)] * len(names)
        for k, tensor in others:
            prints[k] = _fingerprint(tensor)
        if rows:
            for k, row in zip(rows, self._sums(addresses, sizes, device), strict=True):  # type: ignore[arg-type]
                prints[k] = row
        if len({p.device for p in prints}) > 1:
            prints = [p.cpu() for p in prints]
        return names, torch.stack(prints)


def fingerprints(shards: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Fingerprints of each named tensor (one row of three int64 values each), in order (see `Fingerprinter`)."""
    return Fingerprinter()(shards)


class EngineGroups:
    """Which checkpoint tensors vLLM loads into one engine module (a module that receives any must receive all).

    Args:
        naming: where vLLM loads each checkpoint tensor (the model's renaming and `packed_modules_mapping`).
        engine_modules: paths of the engine modules that own parameters (colocate: from the engine model; server:
            from the server's parameter names), or None where the engine does not list them (a server without
            `/weight_checker`, vLLM < 0.32): then every tensor of one decoder layer (the outermost indexed container
            of its name, `model.layers.3`) goes together, a superset of any engine module inside it.
    """

    def __init__(self, naming: EngineNaming, engine_modules: Iterable[str] | None) -> None:
        self._naming = naming
        self._by_layer = engine_modules is None
        self._modules = frozenset(engine_modules or ())
        # Every proper ancestor of an engine module: "does the engine have modules under this path" in one lookup.
        self._ancestors = frozenset(m.rsplit(".", k)[0] for m in self._modules for k in range(1, m.count(".") + 1))

    @classmethod
    def of(cls, layout: EngineLayout) -> EngineGroups:
        """The grouping of an engine, from what it says of its weights (`EngineWriter.engine_layout`)."""
        return cls(layout.naming, layout.modules)

    def group(self, name: str) -> str:
        """The engine module a checkpoint tensor is loaded into: its own, after renaming and fusing; where the
        engine has no module of that path, its parent module when the engine has modules under it (a fused module
        the mapping does not name is a sibling of its parts), else the indexed container it belongs to (fused
        experts: `...mlp.experts` over `...mlp.experts.<i>.gate_proj`, which vLLM loads into one module, e.g.
        `...mlp.experts.routed_experts`)."""
        module = self._naming.parameter(name)[0].rpartition(".")[0]
        if self._by_layer:
            segments = module.split(".")
            index = next((i for i, segment in enumerate(segments) if segment.isdigit()), None)
            return module if index is None else ".".join(segments[: index + 1])
        if module in self._modules or not self._modules:
            return module
        parent = module.rpartition(".")[0]
        if parent and self._has_modules_under(parent):
            return parent
        segments = module.split(".")
        for index in range(len(segments) - 1, 0, -1):
            if segments[index].isdigit():
                container = ".".join(segments[:index])
                if self._has_modules_under(container):
                    return container
        return module

    def _has_modules_under(self, prefix: str) -> bool:
        return prefix in self._ancestors


@dataclass(frozen=True)
class Selection:
    """What one sync gathers and sends.

    Attributes:
        complete: every planned tensor (the first sync, after a failure or a structure change, or delta off).
        gather: trainer names to gather (None: all).
        tensors: the planned tensors sent, in stream order.
        skipped: planned tensors not sent.
        changed: trainer names among the skipped ones that changed since they were last pushed (sent this time).
    """

    complete: bool
    gather: frozenset[str] | None
    tensors: tuple[PlannedTensor, ...]
    skipped: tuple[PlannedTensor, ...] = ()
    changed: tuple[str, ...] = ()


class DeltaTracker:
    """The delta plan of one model structure and the fingerprints of the weights it skips.

    Args:
        tensors: the planned tensors, in stream order.
        trainable: trainer names that can change between syncs (parameters with `requires_grad`).
        merge_targets: checkpoint names that PEFT adapters merge into.
        groups: the engine's module grouping.
    """

    def __init__(
        self,
        tensors: Sequence[PlannedTensor],
        trainable: frozenset[str],
        merge_targets: frozenset[str],
        groups: EngineGroups,
    ) -> None:
        self.tensors = tuple(tensors)
        self.groups = groups
        self.trainable = trainable
        by_group: dict[str, list[PlannedTensor]] = {}
        for t in self.tensors:
            by_group.setdefault(groups.group(t.name), []).append(t)
        self._by_group = by_group
        seeds = {t.name for t in self.tensors if t.name in merge_targets or set(t.sources) & trainable}
        self.always = self.widen(seeds)
        sent_sources = {s for t in self.tensors if t.name in self.always for s in t.sources}
        # Skipped and watched: the sources of every tensor not always sent (a source is never both).
        self.watched = tuple(sorted({s for t in self.tensors if t.name not in self.always for s in t.sources}
                                    - sent_sources))  # fmt: skip
        # The names fingerprinted at the last push, in order, with their fingerprints (one row each).
        self._reference: tuple[tuple[str, ...], torch.Tensor] | None = None
        self._fingerprints = Fingerprinter()
        self._readback = HostReadback()
        self._unchanged: Selection | None = None
        self._primed = False

    def widen(self, names: set[str]) -> frozenset[str]:
        """`names` widened to whole engine modules and to every output of the trainer tensors they come from,
        until nothing more is added."""
        sources_of = {t.name: set(t.sources) for t in self.tensors}
        outputs_of: dict[str, set[str]] = {}
        for t in self.tensors:
            for s in t.sources:
                outputs_of.setdefault(s, set()).add(t.name)
        result = set(names)
        while True:
            grown = {n for name in result for n in (t.name for t in self._by_group[self.groups.group(name)])}
            grown |= {o for name in grown for s in sources_of[name] for o in outputs_of[s]}
            if grown <= result:
                return frozenset(result)
            result |= grown

    @property
    def primed(self) -> bool:
        """Whether a complete sync succeeded since this plan was made (or since the last failure)."""
        return self._primed

    def mark_complete(self) -> None:
        self._primed = True

    def forget(self) -> None:
        """After a failed sync: the next one is complete (the engine may hold anything the failure left)."""
        self._reference = None
        self._primed = False

    def record(self, shards: Iterable[tuple[str, torch.Tensor]], only: Iterable[str] | None = None) -> None:
        """Fingerprint the watched weights (or `only` these) as they were just pushed."""
        names, prints = self._fingerprints(shards)
        if only is None or self._reference is None:
            self._reference = (tuple(names), prints)
            return
        held, reference = self._reference
        where = {n: i for i, n in enumerate(held)}
        fresh = {n: i for i, n in enumerate(names)}
        pairs = [(where[n], fresh[n]) for n in only if n in fresh and n in where]
        if pairs:
            reference = reference.clone()
            into, take = zip(*pairs, strict=True)
            reference[list(into)] = prints[list(take)].to(reference.device)
        added = [n for n in only if n in fresh and n not in where]
        if added:
            held = held + tuple(added)
            reference = torch.cat([reference, prints[[fresh[n] for n in added]].to(reference.device)])
        self._reference = (held, reference)

    def changed(self, shards: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Watched trainer names whose local shard differs from its fingerprint at the last push (this rank).

        NOTE: compared on the device, and read back once (a pinned copy of one flag per tensor): nothing waits for
        the device per tensor.
        """
        assert self._reference is not None, "record() at the complete sync before checking"
        names, now = self._fingerprints(shards)
        if not names:
            return []
        held, reference = self._reference
        if tuple(names) != held:
            where = {n: i for i, n in enumerate(held)}
            reference = reference[[where[n] for n in names]]
        differs = (now != reference.to(now.device)).any(dim=1)
        (flags,) = self._readback.read(differs)
        return [n for n, d in zip(names, flags.tolist(), strict=True) if d]

    def select(self, changed: Iterable[str]) -> Selection:
        """The delta selection: the always-sent tensors plus whatever the changed skipped weights widen to."""
        changed = tuple(sorted(changed))
        if not changed:  # the common case, the same every sync: made once (a walk over every tensor)
            if self._unchanged is None:
                self._unchanged = self._select(())
            return self._unchanged
        return self._select(changed)

    def _select(self, changed: tuple[str, ...]) -> Selection:
        extra = {t.name for t in self.tensors if set(t.sources) & set(changed)}
        sent = self.always | self.widen(extra) if extra else self.always
        tensors = tuple(t for t in self.tensors if t.name in sent)
        skipped = tuple(t for t in self.tensors if t.name not in sent)
        return Selection(False, frozenset(s for t in tensors for s in t.sources), tensors, skipped, changed)

    def complete(self) -> Selection:
        return Selection(True, None, self.tensors)


def nbytes(tensors: Iterable[PlannedTensor], engine_dtype: torch.dtype | None) -> int:
    """Bytes of planned tensors on the wire (floating tensors in the engine dtype)."""
    total = 0
    for t in tensors:
        dtype = engine_dtype if (engine_dtype is not None and t.spec.dtype.is_floating_point) else t.spec.dtype
        total += math.prod(t.spec.shape) * dtype.itemsize
    return total
